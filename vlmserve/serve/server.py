"""`vlmserve serve MODEL`: the OpenAI-compatible server.

The API process (this one) runs FastAPI under uvicorn; the engine runs in a child process. On
SIGTERM the server drains: requests in flight finish while new ones get 503 (the port stays open
until the last one is done), then both processes exit. A client has --read-timeout seconds to send
a request's headers and again its body; past it the connection is closed. At most
--max-connections client connections are open at once (vlmserve/serve/connections.py).
If the engine process dies, requests in flight get an error (a stream gets an error event),
/health answers 503, and the engine is started again, up to --max-engine-restarts times; after
that the server keeps answering 503 until it is restarted. An engine process that sends no
heartbeat (one every 0.5 s, from a thread of its own) for --engine-heartbeat-timeout seconds is
not responding: /health and new requests get 503 naming it until it is heard from again; silent
for --engine-stall-timeout seconds, it is killed and restarted as after a death.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from vlmserve.engine.config import EngineConfig
from vlmserve.engine.frontend import load_frontend
from vlmserve.multimodal.media import MediaLimits
from vlmserve.serve import connections, memory, shm
from vlmserve.serve.app import build_app
from vlmserve.serve.engine_client import EngineClient
from vlmserve.serve.fetch import FetchPolicy
from vlmserve.serve.metrics import Metrics
from vlmserve.serve.serving import ServingContext

logger = logging.getLogger("vlmserve.api")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _limit_mm_per_prompt(text: str) -> dict[str, int]:
    """vLLM's --limit-mm-per-prompt: a JSON object of modality -> items one request may hold."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'expected a JSON object like \'{{"image": 4, "video": 1}}\', got {text!r}')
    for modality, count in value.items():
        if modality not in ("image", "video"):
            raise argparse.ArgumentTypeError(f"unknown modality {modality!r}; image and video are served")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise argparse.ArgumentTypeError(f"{modality}: expected a non-negative integer, got {count!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory or hub id (default: the tiny one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("VLMSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the names a request's model may give (the first is the one responses carry; default: the "
        "checkpoint folder's name); any other name gets 404",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--memory-budget-gib", type=float, default=None)
    p.add_argument("--kv-cache-memory-gib", type=float, default=None)
    p.add_argument("--limit-images", type=int, default=8, help="images per request")
    p.add_argument("--limit-videos", type=int, default=1, help="videos per request")
    p.add_argument(
        "--limit-mm-per-prompt",
        type=_limit_mm_per_prompt,
        default={},
        metavar="JSON",
        help='items per request by modality, as vLLM takes it: \'{"image": 4, "video": 1}\' (0 refuses the '
        "modality); a modality left out keeps --limit-images / --limit-videos",
    )
    p.add_argument("--max-pixels", type=int, default=None, help="engine-wide cap on an image's resized pixels")
    p.add_argument(
        "--allowed-local-media-path",
        type=Path,
        default=None,
        help="allow file:// and local paths, only under this folder (off by default)",
    )
    p.add_argument("--allowed-media-domains", nargs="*", default=[], help="only fetch media from these domains")
    p.add_argument(
        "--allow-media-network",
        action="append",
        default=[],
        metavar="CIDR[:PORT]",
        help="a private network media may be fetched from (refused by default)",
    )
    p.add_argument("--media-fetch-timeout", type=float, default=10.0)
    p.add_argument("--max-media-bytes", type=int, default=20 * 1024 * 1024)
    p.add_argument("--max-image-pixels", type=int, default=8192 * 8192, help="refused before decoding above this")
    p.add_argument(
        "--max-image-tokens",
        type=_positive_int,
        default=None,
        help="tokens one image may need after resizing, checked before decoding (default: what max_pixels gives)",
    )
    p.add_argument(
        "--max-video-tokens",
        type=_positive_int,
        default=None,
        help="tokens one video may need (all its frames), checked before decoding (default: max_model_len - 1)",
    )
    p.add_argument("--max-video-bytes", type=int, default=64 * 1024 * 1024, help="a video file, data URL or download")
    p.add_argument(
        "--max-video-frames", type=int, default=36_000, help="frames a video may hold (counted before decoding)"
    )
    p.add_argument(
        "--max-shm-bytes",
        type=int,
        default=None,
        help="bytes of image pixels in /dev/shm at once, over which a request gets 503 (413 if it alone is over; "
        "default: half of /dev/shm's size)",
    )
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024)
    p.add_argument("--max-n", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=256, help="requests in flight before 429")
    p.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's headers, and then its body (408); the connection is closed",
    )
    p.add_argument(
        "--max-connections",
        type=_positive_int,
        default=1024,
        help="client connections open at once (lowered to fit the open-files limit); past it the one idle "
        "longest is closed",
    )
    p.add_argument("--engine-threads", type=int, default=0, help="torch threads in the engine (0: torch's default)")
    p.add_argument("--max-engine-restarts", type=int, default=3)
    p.add_argument(
        "--engine-heartbeat-timeout",
        type=_positive_float,
        default=10.0,
        metavar="S",
        help="seconds without a heartbeat from the engine process (it sends one every 0.5 s, however long its "
        "step) after which /health and new requests get 503 naming it; requests in flight wait, and all is "
        "normal again when it is heard from (default 10)",
    )
    p.add_argument(
        "--engine-stall-timeout",
        type=_positive_float,
        default=60.0,
        metavar="S",
        help="seconds without a heartbeat after which the engine process is killed and restarted (counts toward "
        "--max-engine-restarts); its requests in flight get 503 naming the stall (default 60, at least "
        "--engine-heartbeat-timeout)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: 'auto' (the checkpoint's generation_config.json), 'vllm' (none), or a folder",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--root-path", default="", help="the prefix a path-routing proxy serves the API under (ASGI root_path)"
    )


def _networks(specs: list[str]) -> tuple[tuple[Any, int | None], ...]:
    out = []
    for spec in specs:
        cidr, _, port = spec.rpartition(":") if spec.count(":") == 1 or spec.endswith("]") else (spec, "", "")
        network = ipaddress.ip_network((cidr or spec).strip("[]"), strict=False)
        out.append((network, int(port) if port else None))
    return tuple(out)


def build(args: argparse.Namespace) -> tuple[FastAPI, Any, EngineClient]:
    if args.model is None:
        from vlmserve.tools.tiny_checkpoint import default_checkpoint_dir

        args.model = str(default_checkpoint_dir())
    GiB = 1 << 30
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        memory_budget_bytes=None if args.memory_budget_gib is None else int(args.memory_budget_gib * GiB),
        kv_cache_memory_bytes=None if args.kv_cache_memory_gib is None else int(args.kv_cache_memory_gib * GiB),
        limit_mm_per_prompt={"image": args.limit_images, "video": args.limit_videos, **args.limit_mm_per_prompt},
        generation_config=args.generation_config,
        mm_processor_kwargs={} if args.max_pixels is None else {"max_pixels": args.max_pixels},
        media_limits=MediaLimits(
            max_bytes=args.max_media_bytes,
            max_image_pixels=args.max_image_pixels,
            max_image_tokens=args.max_image_tokens,
            max_video_tokens=args.max_video_tokens,
            fetch_timeout_s=args.media_fetch_timeout,
            allowed_local_media_path=args.allowed_local_media_path,
            allow_local_files=args.allowed_local_media_path is not None,
            max_video_bytes=args.max_video_bytes,
            max_video_frames=args.max_video_frames,
        ),
    )
    shm.set_max_bytes(args.max_shm_bytes)
    frontend = load_frontend(config)
    names = tuple(args.served_model_name or [Path(args.model).name])
    client = EngineClient(
        config,
        frontend,
        threads=args.engine_threads,
        max_restarts=args.max_engine_restarts,
        heartbeat_timeout_s=args.engine_heartbeat_timeout,
        stall_timeout_s=args.engine_stall_timeout,
    )
    ctx = ServingContext(
        frontend=frontend,
        client=client,
        metrics=Metrics(names[0], frontend.max_model_len),
        fetch_policy=FetchPolicy(
            allowed_domains=tuple(args.allowed_media_domains),
            allowed_networks=_networks(args.allow_media_network),
            max_bytes=args.max_media_bytes,
            timeout_s=args.media_fetch_timeout,
        ),
        model_name=names[0],
        max_n=args.max_n,
        served_model_names=names,
        model_root=args.model,
    )
    app, asgi = build_app(
        ctx,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_queue=args.max_queue,
        read_timeout_s=args.read_timeout,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await client.start()
        yield
        await client.shutdown()

    app.router.lifespan_context = lifespan
    return app, asgi, client


def header_deadline(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline on each request's headers.

    uvicorn times out nothing before a request's headers are complete: a connection that sends
    nothing, or half a request line, would hold its descriptor for ever. Here a connection must
    complete a request's headers within `timeout_s` of opening and of each response's end (idle
    keep-alive connections are also closed by uvicorn's shorter timeout_keep_alive)."""

    class HeaderDeadlineProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def _arm_header_deadline(self) -> None:
            waiting_on = self.cycle  # a new cycle is made when the next request's headers are in
            self.loop.call_later(timeout_s, self._header_deadline_passed, waiting_on)

        def _header_deadline_passed(self, waiting_on: object) -> None:
            if self.cycle is waiting_on and not self.transport.is_closing():
                logger.info("closed a connection that sent no complete request in %g s", timeout_s)
                self.transport.close()

    return HeaderDeadlineProtocol


class DrainingServer(uvicorn.Server):
    """On SIGTERM, keeps accepting connections (so new requests get 503, not a refused connection)
    until the requests in flight are done or timeout_graceful_shutdown passes, then shuts down."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app_state = app.state

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.timeout_graceful_shutdown or 0)
        while self.app_state.in_flight > 0 and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await super().shutdown(sockets)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    memory.return_freed_memory()
    app, asgi, _ = build(args)
    open_files = connections.raise_open_files_limit()
    in_use = connections.open_descriptors()
    max_connections, backlog = connections.connection_limits(args.max_connections, open_files, in_use)
    if max_connections < args.max_connections:
        logger.warning(
            "at most %d client connections fit under the open-files limit of %d", max_connections, open_files
        )
    server = DrainingServer(
        uvicorn.Config(
            asgi,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            http=connections.capped_connections(header_deadline(args.read_timeout), max_connections),
            timeout_keep_alive=min(5.0, args.read_timeout),
            timeout_graceful_shutdown=60,
            backlog=backlog,
            h11_max_incomplete_event_size=16 * 1024,
            lifespan="on",
            root_path=args.root_path,
        ),
        app,
    )
    default_exit = server.handle_exit

    def handle_exit(sig: int, frame: Any) -> None:
        # Drain: new requests get 503 at once; uvicorn lets those in flight finish.
        app.state.draining = True
        logger.info("received %s: finishing requests in flight", signal.Signals(sig).name)
        default_exit(sig, frame)

    server.handle_exit = handle_exit  # type: ignore[method-assign]
    asyncio.run(server.serve())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vlmserve serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    args = parser.parse_intermixed_args(argv)
    if args.engine_stall_timeout < args.engine_heartbeat_timeout:
        parser.error("--engine-stall-timeout must be at least --engine-heartbeat-timeout")
    return run(args)
