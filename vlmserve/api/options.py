"""`vlmserve serve`'s options. Standard library only, so that the command line checks them (and
whether the port is free) before the server's heavy imports and the model load."""

from __future__ import annotations

import argparse
import errno
import os
import socket
from pathlib import Path

from vlmserve.api import browser_guard
from vlmserve.arg_types import (
    add_kernel_flags,
    add_parallel_flags,
    existing_dir,
    fraction,
    hf_overrides,
    limit_mm_per_prompt,
    lora_module,
    max_logprobs,
    network,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    speculative_config,
)
from vlmserve.errors import UsageError, UserError
from vlmserve.parser_names import (
    JSON_TOOL_CALL_PARSER,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    XML_TOOL_CALL_PARSER,
)
from vlmserve.pooling import RUNNERS

LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="checkpoint directory or Hugging Face hub id (default: the embedded demo checkpoint)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=8000, help="TCP port to listen on")
    p.add_argument(
        "--api-key",
        default=os.environ.get("VLMSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics, /ping, /version and the "
        "chat page's files (default: $VLMSERVE_API_KEY, else none)",
    )
    p.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=[],
        metavar="HOST",
        help="Host names requests may give besides localhost, 127.0.0.1, ::1 and --host (* for any); "
        "a server bound to every interface checks none unless this is given",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        type=browser_guard.origins,
        default=[],
        metavar="ORIGIN",
        help="origins a web page may call the API from (CORS; * for any; vLLM's JSON list works too); "
        "default: none, no CORS headers",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names a request's model may give (the first is the one responses carry; default: MODEL's "
        "last path part); any other name gets 404",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV cache dtype; auto: the checkpoint's (float16 becomes bfloat16 on the CPU)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda or cuda:N")
    add_kernel_flags(p)
    add_parallel_flags(p)
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: every decode step runs eagerly (CUDA graphs are used on CUDA with the triton backend)",
    )
    p.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="longest prompt + output in tokens (default: the checkpoint's max_position_embeddings)",
    )
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="requests decoded together")
    p.add_argument(
        "--state-save-interval",
        type=non_negative_int,
        default=1024,
        metavar="TOKENS",
        help="a model with recurrent state (linear attention): save its state for prefix caching every so many prompt "
        "tokens (rounded down to whole KV blocks; 0: not by interval), besides the end of the prompt's first "
        "and last message and its last full block",
    )
    p.add_argument(
        "--saved-state-slots",
        type=positive_int,
        default=None,
        metavar="N",
        help="a model with recurrent state: saved states kept for prefix caching, least recently used evicted, "
        "each the size of one request's state (`vlmserve inspect` prints it; default: --max-num-seqs)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="tokens per engine step; longer prompts are chunked (default: 2048 on the CPU, 8192 on CUDA)",
    )
    p.add_argument(
        "--memory-budget-gib",
        type=positive_float,
        default=None,
        help="memory the engine may use in all (default: a share of a GPU, as below; half the free RAM on the CPU)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        default=0.9,
        help="fraction of a CUDA device's memory the engine plans with, less what other processes and the CUDA "
        "context hold (default: 0.9; ignored on the CPU and with --memory-budget-gib)",
    )
    p.add_argument(
        "--kv-cache-memory-gib",
        type=positive_float,
        default=None,
        help="a fixed KV cache size instead of planning it from the budget (skips the memory profile)",
    )
    p.add_argument("--limit-images", type=non_negative_int, default=8, help="images per request")
    p.add_argument("--limit-videos", type=non_negative_int, default=1, help="videos per request")
    p.add_argument(
        "--speculative-config",
        type=speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\' (drafts from the request\'s own tokens) or \'{"method": "mtp", '
        "\"num_speculative_tokens\": 2}' (a checkpoint's multi-token-prediction head)",
    )
    p.add_argument(
        "--runner",
        choices=RUNNERS,
        default="auto",
        help="generate: text (chat, completions, responses); pooling: embeddings and scores (/v1/embeddings, "
        "/rerank, /score) instead; auto: pooling for an embedding checkpoint (sentence-transformers' files, or "
        "no lm_head) or a reranker --hf-overrides names, else generate (vLLM's)",
    )
    p.add_argument(
        "--hf-overrides",
        type=hf_overrides,
        default={},
        metavar="JSON",
        help="keys over the checkpoint's config.json, as vLLM takes them; a reranker in the yes/no form served as "
        'vLLM serves it: \'{"classifier_from_token": ["no", "yes"]}\' with its architectures (docs/server.md)',
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (PEFT's format) over the model: a request's `model` names one (vLLM's)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=[],
        metavar="NAME=PATH",
        help='adapters loaded at start, each NAME=PATH or vLLM\'s JSON \'{"name": "sql", "path": "/adapters/sql", '
        '"base_model_name": "..."}\'; a request\'s model NAME runs with it; needs --enable-lora',
    )
    p.add_argument(
        "--max-loras",
        type=positive_int,
        default=1,
        help="adapters that may run in one engine step (each request its own or none; vLLM's)",
    )
    p.add_argument("--max-lora-rank", type=positive_int, default=16, help="the largest adapter rank served (vLLM's)")
    p.add_argument(
        "--max-cpu-loras",
        type=positive_int,
        default=None,
        help="adapters kept loaded, the least recently used dropped first and read again from their folder when "
        "asked for (at least --max-loras; default: --max-loras; vLLM's)",
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, which it turns on with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); needs --enable-lora",
    )
    p.add_argument(
        "--limit-mm-per-prompt",
        type=limit_mm_per_prompt,
        default={},
        metavar="JSON",
        help='items per request by modality, as vLLM takes it: \'{"image": 4, "video": 1}\' (0 refuses the '
        "modality; default: --limit-images / --limit-videos for a modality left out)",
    )
    p.add_argument(
        "--max-pixels",
        type=positive_int,
        default=None,
        help="engine-wide cap on an image's resized pixels (default: the checkpoint's preprocessor_config.json)",
    )
    p.add_argument(
        "--allowed-local-media-path",
        type=existing_dir,
        default=None,
        metavar="DIR",
        help="allow file:// and local paths, only under this folder (default: no local files)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="*",
        default=[],
        metavar="DOMAIN",
        help="only fetch media from these domains (default: any public host)",
    )
    p.add_argument(
        "--allow-media-network",
        action="append",
        type=network,
        default=[],
        metavar="CIDR[:PORT]",
        help="a private network media may be fetched from, repeatable (default: none; private addresses refused)",
    )
    p.add_argument("--media-fetch-timeout", type=positive_float, default=10.0, help="seconds to fetch one media URL")
    p.add_argument(
        "--max-media-bytes", type=positive_int, default=20 * 1024 * 1024, help="bytes of one image file or download"
    )
    p.add_argument(
        "--max-image-pixels", type=positive_int, default=8192 * 8192, help="an image's pixels, refused before decoding"
    )
    p.add_argument(
        "--max-image-tokens",
        type=positive_int,
        default=None,
        help="tokens one image may need after resizing, checked before decoding (default: what max_pixels gives)",
    )
    p.add_argument(
        "--max-video-tokens",
        type=positive_int,
        default=None,
        help="tokens one video may need (all its frames), checked before decoding (default: max_model_len - 1)",
    )
    p.add_argument(
        "--max-video-bytes",
        type=positive_int,
        default=64 * 1024 * 1024,
        help="bytes of a video file, data URL or download",
    )
    p.add_argument(
        "--max-video-frames",
        type=positive_int,
        default=36_000,
        help="frames a video may hold (counted before decoding)",
    )
    p.add_argument(
        "--max-shm-bytes",
        type=positive_int,
        default=None,
        help="bytes of image pixels in /dev/shm at once, over which a request gets 503 (413 if it alone is over; "
        "default: half of /dev/shm's size)",
    )
    p.add_argument(
        "--max-body-bytes", type=positive_int, default=32 * 1024 * 1024, help="request body size (413 above it)"
    )
    p.add_argument("--max-n", type=positive_int, default=8, help="largest `n` (samples per request) accepted")
    p.add_argument(
        "--max-seqs-per-request",
        type=positive_int,
        default=None,
        metavar="N",
        help="sequences one request may run at once: its prompts x n (beams too); default: half of "
        "--max-num-seqs, so that other requests keep room, and at least --max-n (one prompt's samples)",
    )
    p.add_argument(
        "--max-prompt-logprobs-tokens",
        type=positive_int,
        default=8192,
        metavar="N",
        help="prompt tokens one request may have scored with prompt_logprobs (each over the whole "
        "vocabulary; for each of its n samples)",
    )
    p.add_argument("--max-queue", type=positive_int, default=256, help="requests in flight before 429")
    p.add_argument(
        "--responses-store-max-entries",
        type=non_negative_int,
        default=1024,
        metavar="N",
        help="Responses API: the most recent responses kept for GET and previous_response_id (0: none kept)",
    )
    p.add_argument(
        "--responses-store-max-bytes",
        type=positive_int,
        default=256 << 20,
        metavar="BYTES",
        help="Responses API: the bytes the kept responses and their conversations may take (as JSON); "
        "the oldest are dropped first",
    )
    p.add_argument(
        "--read-timeout",
        type=positive_float,
        default=30.0,
        help="seconds a client has to send a request's headers, and then its body (408); the connection is closed",
    )
    p.add_argument(
        "--max-connections",
        type=positive_int,
        default=1024,
        help="client connections open at once (lowered to fit the open-files limit); past it the one idle "
        "longest is closed",
    )
    p.add_argument(
        "--engine-threads", type=non_negative_int, default=0, help="torch threads in the engine (0: torch's default)"
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=positive_int,
        default=1,
        metavar="N",
        help="engine processes, each with its own model and KV cache, behind the one API process; each request "
        "goes to the least loaded (on CUDA engine k uses cuda:k; on the CPU they share the cores and the default "
        "memory budget)",
    )
    p.add_argument(
        "--max-engine-restarts",
        type=non_negative_int,
        default=3,
        help="times a dead engine process is started again before the server gives up (503)",
    )
    p.add_argument(
        "--engine-heartbeat-timeout",
        type=positive_float,
        default=10.0,
        metavar="S",
        help="seconds without a heartbeat from the engine process (it sends one every 0.5 s, however long its "
        "step) after which /health and new requests get 503 naming it; requests in flight wait, and all is "
        "normal again when it is heard from",
    )
    p.add_argument(
        "--engine-stall-timeout",
        type=positive_float,
        default=60.0,
        metavar="S",
        help="seconds without a heartbeat after which the engine process is killed and restarted (counts toward "
        "--max-engine-restarts); its requests in flight get 503 naming the stall (at least "
        "--engine-heartbeat-timeout); a tensor-parallel rank silent this long (stopped or hung) fails its step "
        "and the ranks are restarted the same way",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: 'auto' (the checkpoint's generation_config.json), 'vllm' (none), or a folder",
    )
    p.add_argument(
        "--max-logprobs",
        type=max_logprobs,
        default=20,
        metavar="N",
        help="the most logprobs, top_logprobs or prompt_logprobs a request may ask for (vLLM's; -1: up to the "
        "whole vocabulary, which also lets a request ask for -1)",
    )
    p.add_argument(
        "--max-grammar-bytes",
        type=positive_int,
        default=128 * 1024,
        metavar="N",
        help="bytes of a request's structured-output spec (JSON schema, regex, choice, EBNF grammar, or the schema "
        "a forced tool call builds), checked before it reaches the engine (400 above it)",
    )
    p.add_argument(
        "--max-grammar-compile-seconds",
        type=positive_float,
        default=5.0,
        metavar="S",
        help="CPU seconds compiling one request's grammar may take (it compiles beside the steps; the request "
        "waits, the others run); past it the request gets 400",
    )
    p.add_argument(
        "--grammar-cache-gib",
        type=positive_float,
        default=0.5,
        metavar="GIB",
        help="memory for compiled grammars (structured outputs), least recently used evicted, one in use kept; "
        "on the CPU the KV cache is planned after it",
    )
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between the engine's throughput lines while it has work (0: none)",
    )
    p.add_argument(
        "--root-path",
        default="",
        help="the path prefix a path-routing proxy serves the API under (ASGI root_path; default: none)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="split a thinking model's <think> part off its answers as reasoning_content (vLLM's; default: none)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help=(
            f"how answers are read for tool calls (vLLM's names): {JSON_TOOL_CALL_PARSER} (JSON in <tool_call> "
            f"blocks) or {XML_TOOL_CALL_PARSER} (<function=...><parameter=...> blocks in <tool_call>, which forced "
            "calls are written in too); the checkpoint's chat template says which"
        ),
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let requests use tool_choice auto (the default with tools); needs --tool-call-parser (vLLM's)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="render chat requests in this Jinja chat template (a file, or the template inline) instead of the "
        "model's own (vLLM's)",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a request bring its own chat_template (it runs in a sandbox, but can cost the server CPU); "
        "by default such a request gets a 400 (vLLM's)",
    )
    p.add_argument(
        "--disable-web-ui",
        action="store_true",
        help="serve no chat page at / (by default a browser there gets one that talks to this server's API)",
    )
    p.add_argument("--log-level", type=str.lower, default="info", choices=LOG_LEVELS, help="log level")


def check_lora_flags(args: argparse.Namespace) -> None:
    """What the LoRA flags cannot say one by one, and that each adapter's folder exists (before the
    model loads): UsageError naming the flag and the fix."""
    if not args.enable_lora:
        for flag, given in (
            ("--lora-modules", args.lora_modules),
            ("--allow-runtime-lora-updating", args.allow_runtime_lora_updating),
        ):
            if given:
                raise UsageError(f"{flag} needs --enable-lora")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise UsageError(f"--max-cpu-loras ({args.max_cpu_loras}) must be at least --max-loras ({args.max_loras})")
    names = [module.name for module in args.lora_modules]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise UsageError(f"--lora-modules names {', '.join(map(repr, repeated))} more than once")
    served = args.served_model_name or ([Path(args.model).name] if args.model else [])
    for module in args.lora_modules:
        if not Path(module.path).is_dir():
            raise UsageError(
                f"--lora-modules: adapter {module.name!r}: {module.path} is not a directory (the folder holding "
                "adapter_config.json and adapter_model.safetensors)"
            )
        if module.name in served:
            raise UsageError(f"--lora-modules: {module.name!r} is a --served-model-name; give the adapter another name")
        if module.base_model_name is not None and served and module.base_model_name not in served:
            raise UsageError(
                f"--lora-modules: adapter {module.name!r} names base_model_name {module.base_model_name!r}, "
                f"which is not served (--served-model-name: {', '.join(served)})"
            )


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads, so that a port another server listens
    on is reported at once. It listens only once the engine is ready (listen() below): until
    then a client's connection is refused, not left waiting. As vLLM does."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no conflict
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise _port_error(e, host, port) from None
    return sock


def listen(sock: socket.socket, backlog: int = 2048) -> None:
    """Start listening on a socket from bind(). Two servers that bound the same port while both
    were loading meet here: the second one gets the busy-port error. `backlog` bounds the
    connections the kernel queues before they are accepted (see connections.connection_limits)."""
    host, port = sock.getsockname()[:2]
    try:
        sock.listen(backlog)
    except OSError as e:
        raise _port_error(e, host, port) from None


def _port_error(e: OSError, host: str, port: int) -> UserError:
    if e.errno == errno.EADDRINUSE:
        return UserError(
            f"port {port} on {host} is already in use (another server?); stop it or choose another with --port"
        )
    if e.errno == errno.EACCES:
        return UserError(f"no permission to listen on port {port}; choose a port above 1023 with --port")
    return UsageError(f"cannot listen on --host {host} --port {port}: {e.strerror or e}")
