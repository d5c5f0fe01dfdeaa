"""`vlmserve serve MODEL`: the OpenAI-compatible server.

The API process (this one) runs FastAPI under uvicorn; the engine runs in a child process. On
SIGTERM the server drains: requests in flight finish while new ones get 503 (the port stays open
until the last one is done), then both processes exit. A client has --read-timeout seconds to send
a request's headers and again its body; past it the connection is closed. At most
--max-connections client connections are open at once (vlmserve/api/connections.py).
If the engine process dies, requests in flight get an error (a stream gets an error event),
/health answers 503, and the engine is started again, up to --max-engine-restarts times; after
that the server keeps answering 503 until it is restarted. An engine process that sends no
heartbeat (one every 0.5 s, from a thread of its own) for --engine-heartbeat-timeout seconds is
not responding: /health and new requests get 503 naming it until it is heard from again; silent
for --engine-stall-timeout seconds, it is killed and restarted as after a death.
With --data-parallel-size N, N engine processes serve behind this one (dp_client.py), started
together; each request goes to the least loaded one that is up, preferring one that served the
same image or a long common prefix (dp_router.py). A dead engine is restarted alone while the
others serve, and /health answers 200 while any engine can take requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from vlmserve.api import browser_guard, connections, freed_memory
from vlmserve.api.app import build_app
from vlmserve.api.dp_client import DataParallelClient
from vlmserve.api.engine_supervisor import EngineDeadError
from vlmserve.api.fetch import FetchPolicy
from vlmserve.api.frontend import load_frontend
from vlmserve.api.metrics import Metrics
from vlmserve.api.options import add_arguments, bind, check_lora_flags, listen
from vlmserve.api.serving import ServingContext
from vlmserve.api.serving_models import ServingModels
from vlmserve.arg_types import network_and_port, parallel_options
from vlmserve.engine.banner import log_banner
from vlmserve.engine.config import EngineConfig
from vlmserve.errors import UsageError, UserError
from vlmserve.ipc import shm
from vlmserve.multimodal.media import MediaLimits
from vlmserve.parser_names import TOOL_CALL_PARSERS
from vlmserve.progress import LOG_DATE_FORMAT, LOG_FORMAT
from vlmserve.tokenizer import read_chat_template
from vlmserve.version import package_version

logger = logging.getLogger("vlmserve.api")


def _networks(specs: list[str]) -> tuple[tuple[Any, int | None], ...]:
    return tuple(network_and_port(spec) for spec in specs)


def _what_to_ask(model: str) -> dict[str, Any]:
    """The demo checkpoint's own example questions (ServingContext.about, example_questions); any
    other model keeps the general ones."""
    from vlmserve.tools.demo_checkpoint import DEMO_ABOUT, DEMO_QUESTIONS, is_demo_checkpoint

    return {"about": DEMO_ABOUT, "example_questions": DEMO_QUESTIONS} if is_demo_checkpoint(model) else {}


def build(args: argparse.Namespace) -> tuple[FastAPI, Any, DataParallelClient]:
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise UserError(f"--enable-auto-tool-choice needs --tool-call-parser ({' or '.join(TOOL_CALL_PARSERS)})")
    chat_template = None
    if getattr(args, "chat_template", None) is not None:
        try:
            chat_template = read_chat_template(args.chat_template)
        except ValueError as e:
            raise UserError(f"--chat-template {e}") from None
    if args.model is None:
        from vlmserve.tools.tiny_checkpoint import default_checkpoint_dir

        args.model = str(default_checkpoint_dir())
    GiB = 1 << 30
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        memory_budget_bytes=None if args.memory_budget_gib is None else int(args.memory_budget_gib * GiB),
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=None if args.kv_cache_memory_gib is None else int(args.kv_cache_memory_gib * GiB),
        limit_mm_per_prompt={"image": args.limit_images, "video": args.limit_videos, **args.limit_mm_per_prompt},
        generation_config=args.generation_config,
        max_logprobs=args.max_logprobs,
        grammar_cache_bytes=int(args.grammar_cache_gib * GiB),
        state_save_interval=args.state_save_interval,
        saved_state_slots=args.saved_state_slots,
        speculative_config=args.speculative_config,
        max_grammar_compile_seconds=args.max_grammar_compile_seconds,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        runner=args.runner,
        hf_overrides=args.hf_overrides,
        **parallel_options(args),
        rank_stall_timeout_s=args.engine_stall_timeout,
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
    metrics = Metrics(
        names[0],
        frontend.max_model_len,
        args.data_parallel_size,
        max_loras=args.max_loras if args.enable_lora else None,
    )
    models = ServingModels(None, names)
    loras = models.add_static(args.lora_modules)
    client = DataParallelClient(
        config,
        frontend,
        size=args.data_parallel_size,
        threads=args.engine_threads,
        max_restarts=args.max_engine_restarts,
        heartbeat_timeout_s=args.engine_heartbeat_timeout,
        stall_timeout_s=args.engine_stall_timeout,
        metrics=metrics,
        loras=loras,
    )
    models.engines = client
    ctx = ServingContext(
        frontend=frontend,
        client=client,
        metrics=metrics,
        fetch_policy=FetchPolicy(
            allowed_domains=tuple(args.allowed_media_domains),
            allowed_networks=_networks(args.allow_media_network),
            max_bytes=args.max_media_bytes,
            timeout_s=args.media_fetch_timeout,
        ),
        model_name=names[0],
        max_n=args.max_n,
        max_grammar_bytes=args.max_grammar_bytes,
        max_seqs_per_request=args.max_seqs_per_request or max(args.max_n, args.max_num_seqs // 2),
        max_prompt_logprobs_tokens=args.max_prompt_logprobs_tokens,
        served_model_names=names,
        model_root=args.model,
        reasoning_parser=getattr(args, "reasoning_parser", None),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        responses_store_max_entries=getattr(args, "responses_store_max_entries", 1024),
        responses_store_max_bytes=getattr(args, "responses_store_max_bytes", 256 << 20),
        chat_template=chat_template,
        trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
        models=models,
        **_what_to_ask(args.model),
    )
    hosts = browser_guard.allowed_hosts(args.host, getattr(args, "allowed_hosts", []))
    if hosts is None and not getattr(args, "allowed_hosts", []):
        logger.warning(
            "bound to every interface (--host %s): any Host header is accepted; give --allowed-hosts NAME ... "
            "(the names clients use) to refuse the others, and --api-key",
            args.host,
        )
    app, asgi = build_app(
        ctx,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        max_queue=args.max_queue,
        read_timeout_s=args.read_timeout,
        web_ui=not args.disable_web_ui,
        allowed_hosts=hosts,
        allowed_origins=[origin for given in getattr(args, "allowed_origins", []) for origin in given],
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # The engine was started before the server began to listen (serve() below).
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


def quiet_when_cut_short(asgi: Any, app: FastAPI) -> Any:
    """The app, except that a request cancelled because the server stops without waiting (a second
    Ctrl-C during the drain) ends without uvicorn's "Exception in ASGI application" traceback: the
    user asked for it."""

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        try:
            await asgi(scope, receive, send)
        except asyncio.CancelledError:
            if not app.state.draining:
                raise
            with contextlib.suppress(Exception):  # a stream ends where it was cut
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    return wrapped


class DrainingServer(uvicorn.Server):
    """On SIGTERM or Ctrl-C (SIGINT), keeps accepting connections (so new requests get 503, not a
    refused connection) until the requests in flight are done or timeout_graceful_shutdown passes,
    then shuts down; a second Ctrl-C cuts the requests in flight short at once. The signal that
    stopped it is kept (`stopped_by`), not raised again when it returns (uvicorn's default, which
    turns a Ctrl-C into a KeyboardInterrupt in the middle of the shutdown)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app_state = app.state
        self.stopped_by: int | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.timeout_graceful_shutdown or 0)
        while self.app_state.in_flight > 0 and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.force_exit:
            for task in self.server_state.tasks:
                task.cancel()  # the requests a second Ctrl-C cut short
        await super().shutdown(sockets)
        if self.force_exit:
            await self.lifespan.shutdown()  # uvicorn skips it then: it stops the engine


def run(args: argparse.Namespace, sock: socket.socket | None = None) -> int:
    """Serve until SIGTERM on `sock` (bound from --host and --port if not given). Raises
    UserError if the engine cannot start (its own error is logged above)."""
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT, datefmt=LOG_DATE_FORMAT)
    # The engine process inherits these.
    os.environ["VLMSERVE_LOG_LEVEL"] = args.log_level
    os.environ["VLMSERVE_LOG_STATS_INTERVAL"] = str(args.log_stats_interval)
    freed_memory.return_freed_memory()
    open_files = connections.raise_open_files_limit()
    sock = sock or bind(args.host, args.port)
    app, asgi, client = build(args)
    asgi = quiet_when_cut_short(asgi, app)
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
        # Drain: new requests get 503 at once; uvicorn lets those in flight finish (a second
        # SIGINT: not).
        if server.stopped_by is None:
            server.stopped_by = sig
            logger.info("received %s: finishing requests in flight", signal.Signals(sig).name)
        elif sig == signal.SIGINT:
            logger.info("received SIGINT again: stopping now")
        app.state.draining = True
        default_exit(sig, frame)

    server.handle_exit = handle_exit  # type: ignore[method-assign]
    try:
        asyncio.run(_serve(server, client, sock, backlog, web_ui=not args.disable_web_ui))
    except KeyboardInterrupt:  # Ctrl-C while the engine loaded, before the server's own handlers
        logger.info("interrupted while starting: the engine was stopped")
        return 130
    return 130 if server.stopped_by == signal.SIGINT else 0


async def _serve(
    server: DrainingServer, client: DataParallelClient, sock: socket.socket, backlog: int, web_ui: bool = True
) -> None:
    """The engine first (loading and profiling the model), then the HTTP server on `sock`."""
    try:
        await client.start()
    except EngineDeadError as e:
        await client.shutdown()
        raise UserError(f"the engine did not start: {e}") from None
    except asyncio.CancelledError:  # Ctrl-C while it loads: asyncio.run cancels this task
        await client.shutdown()
        raise
    try:
        listen(sock, backlog)
    except UserError:
        await client.shutdown()
        raise
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"
    summary = client.engines[0].engine.summary
    if len(client.engines) > 1:
        pids = ", ".join(f"{k} (pid {engine.engine.pid})" for k, engine in enumerate(client.engines))
        summary = {**summary, "data parallel": f"{len(client.engines)} engines: {pids}"}
    log_banner(logger, summary, f"vlmserve {package_version()} ready", url)
    if web_ui:
        logger.info("chat page: open %s/ in a browser (--disable-web-ui: no page)", url.removesuffix("/v1"))
    await server.serve(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vlmserve serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    args = parser.parse_intermixed_args(argv)
    if args.engine_stall_timeout < args.engine_heartbeat_timeout:
        parser.error("--engine-stall-timeout must be at least --engine-heartbeat-timeout")
    try:
        check_lora_flags(args)
    except UsageError as e:
        parser.error(str(e))
    return run(args)
