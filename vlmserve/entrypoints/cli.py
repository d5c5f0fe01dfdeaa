"""The `vlmserve` command line.

vlmserve chat [MODEL] [--image PATH ...] [--video PATH ...] [--draw-boxes OUT.png] "question"
                                                       stream an answer (and draw its boxes)
vlmserve make-tiny OUT_DIR [--arch qwen2_5_vl|qwen_vl] write a tiny random-weight checkpoint
vlmserve inspect MODEL_OR_CONFIG [--dtype bfloat16]    parameters per part, weight and KV cache memory
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from vlmserve import LLM
    from vlmserve.grounding import Convention
    from vlmserve.outputs import MultiModalItemInfo


def _chat(args: argparse.Namespace) -> int:
    from vlmserve import LLM, SamplingParams

    if len(args.words) > 2:
        print("error: give at most MODEL and one quoted question", file=sys.stderr)
        return 2
    if args.draw_boxes is not None and not args.image:
        print("error: --draw-boxes needs an --image to draw on", file=sys.stderr)
        return 2
    model, question = (None, args.words[0]) if len(args.words) == 1 else args.words
    if model is None:
        print(
            "(no MODEL given: using the embedded tiny random-weight checkpoint; its answers are random text)",
            file=sys.stderr,
        )
    llm = LLM(
        model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=1,
        limit_mm_per_prompt={"image": max(8, len(args.image)), "video": max(1, len(args.video))},
        generation_config=args.generation_config,
    )
    content: list[dict[str, object]] = [{"type": "image", "image": image} for image in args.image]
    content += [{"type": "video", "video": video} for video in args.video]
    content.append({"type": "text", "text": question})
    messages: list[dict[str, object]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": content})
    defaults = llm.get_default_sampling_params()
    try:
        params = SamplingParams(
            temperature=defaults.temperature if args.temperature is None else args.temperature,
            top_p=defaults.top_p,
            top_k=defaults.top_k,
            min_p=defaults.min_p,
            repetition_penalty=defaults.repetition_penalty
            if args.repetition_penalty is None
            else args.repetition_penalty,
            max_tokens=args.max_tokens,
            seed=args.seed,
            # Qwen2-VL writes boxes with special tokens (<|box_start|>...): keep them in the text.
            skip_special_tokens=args.draw_boxes is None,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        prompt = llm.process_chat(messages)
        convention = _box_convention(llm, args) if args.draw_boxes is not None else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shown = 0
    text = ""
    mm_items: list[MultiModalItemInfo] = []
    for output in llm.stream(prompt, params):
        text = output.outputs[0].text
        print(text[shown:], end="", flush=True)
        shown = len(text)
        mm_items = output.mm_items
    print()
    if convention is not None:
        # The latest picture, as Qwen-VL's draw_bbox_on_latest_picture: the one the question is about.
        latest = [item for item in mm_items if item.modality == "image"][-1]
        return _draw_boxes(text, args.image[-1], latest, convention, args.draw_boxes)
    return 0


def _box_convention(llm: LLM, args: argparse.Namespace) -> Convention:
    from vlmserve.registry import convention_for_model

    return args.box_convention or cast("Convention", convention_for_model(llm.llm_engine.model_config.model_type))


def _draw_boxes(text: str, source: str, item: MultiModalItemInfo, convention: Convention, out: Path) -> int:
    """The answer's boxes on the latest image, in its original pixels: printed, and drawn into `out`."""
    from vlmserve.grounding import draw_answer
    from vlmserve.multimodal.media import load_image

    try:
        image = load_image(source, "the latest image")  # as the processor decoded it (EXIF rotation applied)
        if image.size != tuple(item.original_size):
            raise ValueError(f"{source} is {image.size} now; the model saw it as {item.original_size}")
        _, lines = draw_answer(text, image, convention, item.resized_size, out)
    except (OSError, ValueError) as e:  # MediaError is a ValueError
        print(f"error: --draw-boxes: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from vlmserve.registry import BY_NAME

    family = BY_NAME[args.arch]
    try:
        out = family.write_tiny(
            args.out_dir,
            seed=args.seed,
            num_shards=args.shards,
            preset=args.preset,
            nested_config=args.nested_config,
            untied=args.untied,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote a {args.preset} random-weight {family.display_name} checkpoint to {out}")
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
    chat.add_argument("--video", action="append", default=[], help="video path or URL (repeatable; 2 frames/s)")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=None, help="default: the checkpoint's generation config")
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument(
        "--repetition-penalty", type=float, default=None, help="default: the checkpoint's generation config"
    )
    chat.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: auto (the checkpoint's), vllm (none), or a folder",
    )
    chat.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    chat.add_argument("--device", default="auto", help="auto, cpu or cuda")
    chat.add_argument("--max-model-len", type=int, default=8192)
    chat.add_argument(
        "--draw-boxes",
        type=Path,
        default=None,
        metavar="OUT.png",
        help="parse the answer's grounding boxes, print them in the latest image's original pixels and draw them "
        "on it into this PNG",
    )
    chat.add_argument(
        "--box-convention",
        choices=["qwen-vl", "qwen2-vl", "qwen2.5-vl", "qwen3-vl"],
        default=None,
        help="how the model writes boxes (default: from the checkpoint's model_type): qwen-vl, qwen2-vl and qwen3-vl "
        "on a 0..1000 scale, qwen2.5-vl in the resized image's pixels",
    )
    chat.set_defaults(func=_chat)
    return chat


def _make_tiny_parser() -> argparse.ArgumentParser:
    from vlmserve.registry import BY_NAME, FAMILIES

    tiny = argparse.ArgumentParser(
        prog="vlmserve make-tiny",
        description="Write a tiny random-weight Qwen2-VL, Qwen2.5-VL or Qwen-VL-Chat checkpoint in the hub layout.",
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
    tiny.add_argument(
        "--arch",
        choices=list(BY_NAME),
        default=FAMILIES[0].name,
        help="model family: " + ", ".join(f"{f.name} ({f.display_name})" for f in FAMILIES),
    )
    tiny.set_defaults(func=_make_tiny)
    return tiny


def _inspect(args: argparse.Namespace) -> int:
    from vlmserve.config import parse_dtype
    from vlmserve.inspect import format_report, inspect_config, load_config

    try:
        config = load_config(args.model)
        dtype = parse_dtype(args.dtype, config.checkpoint_dtype or parse_dtype("bfloat16"))
        report = inspect_config(config, dtype)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 0


def _inspect_parser() -> argparse.ArgumentParser:
    inspect = argparse.ArgumentParser(
        prog="vlmserve inspect",
        description="Count a model's parameters per part and the memory its weights and KV cache need, from its "
        "config.json alone (no weights are read).",
    )
    inspect.add_argument("model", metavar="MODEL_OR_CONFIG", help="a checkpoint directory or a config.json")
    inspect.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="dtype of the weights and KV cache (default: the checkpoint's, else bfloat16)",
    )
    inspect.set_defaults(func=_inspect)
    return inspect


COMMANDS = {"chat": _chat_parser, "make-tiny": _make_tiny_parser, "inspect": _inspect_parser}


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
