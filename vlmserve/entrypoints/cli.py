"""The `vlmserve` command line, in the conventions of vllm and ollama: `vlmserve COMMAND [options]`,
every command listed by `vlmserve --help`, `vlmserve --version`, an unknown command or option
refused by name (no abbreviations), every option with its help and default.

Errors a user can put right (a model path, an image path, an option's value, a busy port) are one
line on stderr: exit code 2 when the command line is wrong, 1 when running it failed. --debug
shows tracebacks and debug log lines. What is cheap to check (paths, the port, values) is checked
before torch is imported and before a model loads; each command imports what it needs only then.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from vlmserve.arg_types import (
    add_kernel_flags,
    add_parallel_flags,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from vlmserve.errors import UsageError, UserError

DTYPES = ["auto", "float32", "bfloat16", "float16"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; each option's default appended unless its help already says it."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)  # most options' names fit before their help

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.option_strings or action.nargs in ("?", "*")
        if not shown or action.default in (None, False, [], argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """No abbreviated options; a bad command line is one line naming what is wrong."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(allow_abbrev=False, formatter_class=HelpFormatter, **kwargs)  # type: ignore[arg-type]

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}{self._did_you_mean(message)} (see '{self.prog} --help')\n")

    def _did_you_mean(self, message: str) -> str:
        """For an unknown option, the closest options this command has (as a mistyped command gets)."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        known = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        guesses = []
        for word in message.split(":", 1)[1].split():
            if word.startswith("--"):
                close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1)
                guesses += [f"'{close[0]}' for '{word}'"] if close else []
        return f"; did you mean {', '.join(guesses)}?" if guesses else ""


@dataclass(frozen=True)
class Command:
    summary: str  # the line in `vlmserve --help`
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    usage: str | None = None


# -- serve ----------------------------------------------------------------------------------------


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    from vlmserve.api.options import add_arguments

    add_arguments(p)


def _serve(args: argparse.Namespace) -> int:
    from vlmserve.api.options import bind, check_lora_flags

    _check_model(args.model)
    if args.engine_stall_timeout < args.engine_heartbeat_timeout:
        raise UsageError("--engine-stall-timeout must be at least --engine-heartbeat-timeout")
    check_lora_flags(args)
    sock = bind(args.host, args.port)  # before the model loads: a busy port is said at once
    if args.debug:
        args.log_level = "debug"
    if args.model is None:
        from vlmserve.entrypoints.chat import DEMO_NOTE

        print(DEMO_NOTE, file=sys.stderr)
    from vlmserve.api.server import run

    return run(args, sock)


# -- chat -----------------------------------------------------------------------------------------


def _chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "words",
        nargs="*",
        metavar="[MODEL] [QUESTION]",
        help="checkpoint directory or hub id (default: the embedded demo checkpoint), then the "
        "question; without a question, a conversation (a single word that names a directory or an org/name "
        "hub id is the MODEL)",
    )
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH_OR_URL",
        help="an image for the first question (repeatable)",
    )
    p.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="PATH_OR_URL",
        help="a video for the first question (repeatable; 2 frames/s)",
    )
    p.add_argument("--system", default=None, help="system prompt (default: the chat template's)")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens per answer, at most")
    p.add_argument(
        "--temperature",
        type=non_negative_float,
        default=None,
        help="0: greedy (default: the checkpoint's generation config)",
    )
    p.add_argument("--seed", type=int, default=None, help="makes sampled answers reproducible (default: none)")
    p.add_argument(
        "--repetition-penalty",
        type=positive_float,
        default=None,
        help="above 1 discourages repeating prompt and answer tokens (default: the checkpoint's generation config)",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: auto (the checkpoint's generation_config.json), vllm (none), or a folder",
    )
    p.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="auto: the checkpoint's (float16 becomes bfloat16 on the CPU)"
    )
    p.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda or cuda:N")
    add_kernel_flags(p)
    add_parallel_flags(p)
    p.add_argument("--max-model-len", type=positive_int, default=8192, help="longest conversation + answer, in tokens")
    p.add_argument(
        "--draw-boxes",
        type=Path,
        default=None,
        metavar="OUT.png",
        help="parse each answer's grounding boxes, print them in the latest image's original pixels and draw them "
        "on it into this PNG (in a conversation: OUT-1.png, OUT-2.png, ... one per turn)",
    )
    _box_convention_argument(p)


class _RegisteredConventions:
    """--box-convention's choices: the registered families' grounding conventions, by name, looked
    up only when argparse checks a value given or prints the help (the registry imports torch,
    which parsing a command line does not need)."""

    def _names(self) -> list[str]:
        from vlmserve.registry import GROUNDING_CONVENTIONS

        return list(GROUNDING_CONVENTIONS)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()


def _box_convention_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--box-convention",
        choices=_RegisteredConventions(),
        metavar="NAME",  # not the choices: listing them would look them up as the parser is built
        default=None,
        help="how the model writes boxes, by the name of a family's convention: %(choices)s (default: the "
        "model's family's, from its model_type; vlmserve/grounding.py says each one's syntax and scale)",
    )


def _chat(args: argparse.Namespace) -> int:
    from vlmserve.entrypoints import chat
    from vlmserve.model_files import looks_like_hub_id

    words = args.words
    if len(words) > 2:
        raise UsageError(f"give at most MODEL and one quoted QUESTION, got {len(words)} words (quote the question)")
    model: str | None = None
    question: str | None = None
    if len(words) == 2:
        model, question = words
    elif len(words) == 1 and (Path(words[0]).expanduser().is_dir() or looks_like_hub_id(words[0])):
        model = words[0]
    elif len(words) == 1:
        question = words[0]
    args.interactive = question is None
    for flag, sources in (("--image", args.image), ("--video", args.video)):
        for source in sources:
            problem = chat.check_local_media(source, flag.removeprefix("--"))
            if problem:
                raise UsageError(f"{flag} {source}: {problem}")
    if args.draw_boxes is not None and not args.image and not args.interactive:
        raise UsageError("--draw-boxes needs an --image to draw on")
    _check_model(model)
    return chat.run(args, model, question)


# -- worker ---------------------------------------------------------------------------------------


def _worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="the checkpoint directory or hub id (this machine's copy)")
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when present, else cpu"
    )
    add_parallel_flags(p)


def _worker(args: argparse.Namespace) -> int:
    _check_model(args.model)
    if args.node_rank == 0:
        raise UsageError("--node-rank 0 runs the engine (vlmserve serve or chat); a worker is node 1 or above")
    if args.master_port is None:
        raise UsageError("--master-port (or $MASTER_PORT) is needed: node 0's port where the ranks meet")
    from vlmserve.engine.config import check_parallel_layout

    try:
        check_parallel_layout(args.tensor_parallel_size, args.nnodes, args.node_rank)
    except ValueError as e:
        raise UsageError(str(e)) from None
    import torch

    from vlmserve.engine.worker import run_node
    from vlmserve.model_files import resolve_model_dir

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = resolve_model_dir(args.model)
    return run_node(
        str(model_dir),
        args.tensor_parallel_size,
        args.nnodes,
        args.node_rank,
        args.master_addr,
        args.master_port,
        device,
    )


# -- make-tiny, inspect, bench --------------------------------------------------------------------


def _make_tiny_arguments(p: argparse.ArgumentParser) -> None:
    from vlmserve.family_names import NAMES  # not the registry: a usage error must not wait for torch

    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="folder to write (replaced if it exists)")
    p.add_argument(
        "--arch",
        choices=list(NAMES),
        default=next(iter(NAMES)),
        help="model family: " + ", ".join(f"{name} ({display})" for name, display in NAMES.items()),
    )
    p.add_argument(
        "--preset",
        choices=["tiny", "bench", "2b", "embedding", "reranker", "embedding-2b", "embedding-bench"],
        default="tiny",
        help="bench: the 2B's language-model width with 4 layers and a narrow vision tower (qwen2_vl, "
        "qwen3_vl, qwen3_5); 2b: the whole Qwen2-VL-2B or Qwen3-VL-2B architecture (qwen2_vl, qwen3_vl; about "
        "4.4 GB in bfloat16), Qwen3.5-2B's language model with a narrow vision tower (qwen3_5); embedding, "
        "reranker: the tiny Qwen3-VL in Qwen3-VL-Embedding's layout (no lm_head, sentence-transformers' files) "
        "or Qwen3-VL-Reranker's (an untied lm_head) (qwen3_vl); embedding-2b: the whole Qwen3-VL-Embedding-2B "
        "architecture in that layout (qwen3_vl; about 4.3 GB in bfloat16); embedding-bench: its widths with bench's "
        "4 decoder layers and narrow tower (qwen3_vl)",
    )
    p.add_argument("--nested-config", action="store_true", help="transformers 5 config layout (text_config)")
    p.add_argument("--untied", action="store_true", help="separate lm_head weights")
    p.add_argument(
        "--shards", type=positive_int, default=1, help="number of safetensors shards (more than 1: an index)"
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random weights")


def _make_tiny(args: argparse.Namespace) -> int:
    from vlmserve.registry import BY_NAME

    family = BY_NAME[args.arch]
    out = family.write_tiny(
        args.out_dir,
        seed=args.seed,
        num_shards=args.shards,
        preset=args.preset,
        nested_config=args.nested_config,
        untied=args.untied,
    )
    print(f"wrote a {args.preset} random-weight {family.display_name} checkpoint to {out}")
    return 0


def _inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        metavar="MODEL_OR_CONFIG",
        help="a checkpoint directory, a config.json, or a hub id (org/name: its config.json alone is fetched)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="dtype of the weights and KV cache (default: the checkpoint's, else bfloat16)",
    )
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["int8"],
        help="also show the weights' size under int8 weight-only quantization (an AWQ/GPTQ checkpoint's "
        "packed size is shown without it)",
    )
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1, help="also show each rank's weight bytes")


def _inspect(args: argparse.Namespace) -> int:
    from vlmserve.model_files import config_json_path, hub_config, looks_like_hub_id

    # The path or hub id first, before torch is imported: a mistake is said at once.
    try:
        config_json = hub_config(args.model) if looks_like_hub_id(args.model) else config_json_path(args.model)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    except OSError as e:  # no network, the hub down
        raise UserError(str(e)) from None
    from vlmserve.config import parse_dtype
    from vlmserve.inspect import format_report, inspect_config, load_config
    from vlmserve.models.quant import read_packed_config

    try:
        config = load_config(config_json)
    except OSError as e:
        raise UsageError(str(e)) from None
    try:
        packed = read_packed_config(config_json / "config.json" if config_json.is_dir() else config_json)
    except ValueError as e:  # a quantization_config vlmserve cannot load
        raise UserError(str(e)) from None
    if packed is not None and args.quantization is not None:
        raise UsageError(f"--quantization {args.quantization}: the checkpoint is already quantized ({packed.method})")
    dtype = parse_dtype(args.dtype, config.checkpoint_dtype or parse_dtype("bfloat16"))
    try:
        report = inspect_config(config, dtype, packed or args.quantization, args.tensor_parallel_size)
    except ValueError as e:  # a family or head count that cannot be sharded that way
        raise UsageError(f"--tensor-parallel-size {args.tensor_parallel_size}: {e}") from None
    print(format_report(report))
    return 0


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    from vlmserve.bench.options import add_arguments

    add_arguments(p)


def _bench(args: argparse.Namespace) -> int:
    _check_model(args.model)
    from vlmserve.bench.main import run

    run(args)
    return 0


COMMANDS: dict[str, Command] = {
    "serve": Command(
        "Run the OpenAI-compatible HTTP server",
        "Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, "
        "/health, /metrics).\nThe engine runs in a child process; see docs/server.md for the safety options.",
        _serve_arguments,
        _serve,
    ),
    "chat": Command(
        "Ask about images in the terminal: one question or a conversation",
        "With a QUESTION: stream the answer and exit. Without one: a conversation, one line per turn, the history "
        "kept\n(/image PATH attaches an image to the next turn, /help lists the commands, Ctrl-D quits).",
        _chat_arguments,
        _chat,
        usage="vlmserve chat [options] [MODEL] [QUESTION]",
    ),
    "worker": Command(
        "Run this machine's tensor-parallel ranks of an engine on node 0",
        "Join a tensor-parallel engine whose core runs on node 0 (vlmserve serve/chat with --nnodes): this "
        "machine's\nranks (--tensor-parallel-size / --nnodes of them) build their shard of MODEL and run every step "
        "with the\nothers. Exits when the engine shuts down or a rank dies. See docs/server.md, "
        '"Tensor parallelism and many machines".',
        _worker_arguments,
        _worker,
    ),
    "bench": Command(
        "Benchmark vlmserve against transformers",
        "A synthetic multimodal workload through vlmserve and transformers' generate on the same checkpoint:\n"
        "throughput, time to first token, time per output token, sweeps; writes bench.json and bench.png.",
        _bench_arguments,
        _bench,
    ),
    "make-tiny": Command(
        "Write a tiny random-weight checkpoint (hub layout)",
        "Write a tiny random-weight checkpoint (Qwen2-VL, Qwen2.5-VL or Qwen-VL-Chat) in the published layout.",
        _make_tiny_arguments,
        _make_tiny,
    ),
    "inspect": Command(
        "Parameters and memory of a model, from config.json",
        "Parameters per part, and the memory its weights and KV cache need, from config.json alone (no weights).",
        _inspect_arguments,
        _inspect,
    ),
}


def _check_model(model: str | None) -> None:
    """A local checkpoint path must be one (hub ids are downloaded, and checked, when loading)."""
    from vlmserve.model_files import looks_like_hub_id, resolve_model_dir

    if model is None or looks_like_hub_id(model):
        return
    try:
        resolve_model_dir(model)
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None


def top_parser() -> Parser:
    from vlmserve.version import package_version

    width = max(len(name) for name in COMMANDS) + 2
    commands = "\n".join(f"  {name.ljust(width)}{command.summary}" for name, command in COMMANDS.items())
    parser = Parser(
        prog="vlmserve",
        usage="vlmserve [-h] [--version] COMMAND [options]",
        description=f"A serving engine for the Qwen vision-language family.\n\ncommands:\n{commands}",
        epilog="Run 'vlmserve COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"vlmserve {package_version()}")
    return parser


def command_parser(name: str) -> Parser:
    command = COMMANDS[name]
    parser = Parser(prog=f"vlmserve {name}", description=command.description, usage=command.usage)
    command.add_arguments(parser)
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show tracebacks, and debug log lines (the prompt token ids the engine receives among them)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `vlmserve` command. A server run from the command line (argv None: this process's own)
    exits without the interpreter's teardown once it has stopped (progress.exit_now)."""
    own_process = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        top_parser().print_help(sys.stderr)
        return 2
    name = argv[0]
    if name not in COMMANDS:
        parser = top_parser()
        if name in ("-h", "--help", "--version"):
            parser.parse_args(argv[:1])  # prints and exits 0
        what = "option" if name.startswith("-") else "command"
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        parser.error(f"unknown {what} '{name}' (the commands: {', '.join(COMMANDS)}){hint}")
    parser = command_parser(name)
    # Options may come before, between or after the positional words ("MODEL --image X QUESTION").
    args = parser.parse_intermixed_args(argv[1:])
    from vlmserve.progress import configure_logging, exit_now

    configure_logging("DEBUG" if args.debug else getattr(args, "log_level", "INFO"))
    try:
        code = int(COMMANDS[name].run(args))
        if own_process and name == "serve":
            exit_now(code)  # the engine is stopped and the server's resources released
        return code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except UserError as e:
        return _fail(parser.prog, str(e), e.exit_code, args.debug)
    except ValueError as e:  # a value the engine refused: max_model_len, the memory budget, ...
        return _fail(parser.prog, str(e), 2, args.debug)
    except OSError as e:  # a download, a file that cannot be read or written
        return _fail(parser.prog, str(e), 2 if isinstance(e, FileNotFoundError) else 1, args.debug)
    except Exception as e:
        return _fail(parser.prog, f"{type(e).__name__}: {e} (--debug shows where)", 1, args.debug)


def _fail(prog: str, message: str, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)  # one line
    return code


if __name__ == "__main__":
    sys.exit(main())
