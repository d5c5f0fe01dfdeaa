"""The `vlmserve` command line.

vlmserve chat [MODEL] [--image PATH ...] "question"   stream an answer
vlmserve make-tiny OUT_DIR                             write a tiny random-weight checkpoint
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _chat(args: argparse.Namespace) -> int:
    from vlmserve import LLM, SamplingParams

    if len(args.words) > 2:
        print("error: give at most MODEL and one quoted question", file=sys.stderr)
        return 2
    model, question = (None, args.words[0]) if len(args.words) == 1 else args.words
    if model is None:
        print(
            "(no MODEL given: using the embedded tiny random-weight checkpoint; its answers are random text)",
            file=sys.stderr,
        )
    llm = LLM(model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, max_num_seqs=1)
    content: list[dict[str, object]] = [{"type": "image", "image": image} for image in args.image]
    content.append({"type": "text", "text": question})
    messages: list[dict[str, object]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": content})
    defaults = llm.get_default_sampling_params()
    params = SamplingParams(
        temperature=defaults.temperature if args.temperature is None else args.temperature,
        top_p=defaults.top_p,
        top_k=defaults.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    try:
        prompt = llm.process_chat(messages)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shown = 0
    for output in llm.stream(prompt, params):
        text = output.outputs[0].text
        print(text[shown:], end="", flush=True)
        shown = len(text)
    print()
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    import dataclasses

    from vlmserve.tools.tiny_checkpoint import BENCH_SPEC, TinySpec, write_tiny_qwen2_vl

    base = BENCH_SPEC if args.preset == "bench" else TinySpec()
    spec = dataclasses.replace(base, tie_word_embeddings=not args.untied)
    out = write_tiny_qwen2_vl(
        args.out_dir, spec, seed=args.seed, nested_config=args.nested_config, num_shards=args.shards
    )
    print(f"wrote a {args.preset} random-weight Qwen2-VL checkpoint to {out}")
    return 0


def _chat_parser() -> argparse.ArgumentParser:
    chat = argparse.ArgumentParser(
        prog="vlmserve chat", description="Ask one question, optionally about images, and stream the answer."
    )
    chat.add_argument(
        "words",
        nargs="+",
        metavar="[MODEL] QUESTION",
        help="checkpoint directory or hub id (default: the embedded tiny checkpoint), then the question",
    )
    chat.add_argument("--image", action="append", default=[], help="image path or URL (repeatable)")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=None, help="default: the checkpoint's generation config")
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    chat.add_argument("--device", default="auto", help="auto, cpu or cuda")
    chat.add_argument("--max-model-len", type=int, default=8192)
    chat.set_defaults(func=_chat)
    return chat


def _make_tiny_parser() -> argparse.ArgumentParser:
    tiny = argparse.ArgumentParser(
        prog="vlmserve make-tiny", description="Write a tiny random-weight Qwen2-VL checkpoint in the hub layout."
    )
    tiny.add_argument("out_dir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--nested-config", action="store_true", help="transformers 5 config layout (text_config)")
    tiny.add_argument("--untied", action="store_true", help="separate lm_head weights")
    tiny.add_argument("--shards", type=int, default=1, help="number of safetensors shards (with an index)")
    tiny.add_argument(
        "--preset",
        choices=["tiny", "bench"],
        default="tiny",
        help="bench: Qwen2-VL-2B's language-model width with 4 layers and a narrow vision tower",
    )
    tiny.set_defaults(func=_make_tiny)
    return tiny


COMMANDS = {"chat": _chat_parser, "make-tiny": _make_tiny_parser}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from vlmserve.bench.main import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "serve":
        from vlmserve.serve.server import main as serve_main

        return serve_main(argv[1:])
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    # Options may come before, between or after the positional words ("MODEL --image X QUESTION").
    args = COMMANDS[argv[0]]().parse_intermixed_args(argv[1:])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
