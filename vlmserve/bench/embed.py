"""Embeddings of a pooling model (Qwen3-VL-Embedding): the same image+text inputs through
vlmserve's LLM.embed, all given at once (the engine batches them), and through transformers at
each batch size (right-padded, as the checkpoint's official script runs it: bench/embed_hf.py),
in alternating rounds after a warm-up; embeddings per second of each, transformers' best batch
size, the ratio vlmserve / best, and the largest cosine distance between the two engines'
embeddings of the same input (they compute the same thing: tiny in float32, small in bfloat16).

    python -m vlmserve.bench.embed DIR [--inputs 64] [--image-size 448] [--batch-sizes 1,4,16,64]
        [--dtype auto] [--rounds 3]

An input is the official script's object {"text": ..., "image": ...}: a deterministic
image-size x image-size picture and a short text of its own, under the default instruction. Both
engines' times run from those inputs to the vectors (the prompt rendered, the image resized and
cut into patches, the forward, the pooling). Each round draws new pictures, so that no cache of
an earlier round's images (encoder outputs, prefix blocks) serves the next one."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image

# The checkpoints bench/embed_hf.py runs (Qwen3-VL's 16-pixel patches, its prompt and token types).
QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
SUBJECTS = [
    "a red bicycle leaning on a brick wall",
    "two cats asleep on a sofa",
    "a lighthouse at dusk",
    "a bowl of ramen with an egg",
    "children flying kites on a beach",
    "a snowy mountain road",
    "an old map of a harbour",
    "a chart of monthly rainfall",
]


def embedding_inputs(count: int, image_size: int, seed: int) -> list[dict[str, Any]]:
    """`count` inputs, each a picture of image_size x image_size drawn from `seed` and its index,
    and a short text no other input has."""
    inputs = []
    for i in range(count):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + i)
        # Coarse random blocks scaled up: a picture with edges, not pixel noise.
        blocks = torch.randint(0, 256, (max(1, image_size // 16), max(1, image_size // 16), 3), generator=generator)
        small = Image.fromarray(blocks.to(torch.uint8).numpy(), "RGB")
        image = small.resize((image_size, image_size), Image.Resampling.BILINEAR)
        inputs.append({"text": f"Photo {i}: {SUBJECTS[i % len(SUBJECTS)]}.", "image": image})
    return inputs


def max_model_len_for(image_size: int) -> int:
    """Room for one input: the image's tokens (one per 32 x 32 pixels, within the official
    script's 1800-token bound) and the conversation around it, rounded up to 256."""
    image_tokens = min(1800, max(4, (-(-image_size // 32)) ** 2))
    return 256 * -(-(image_tokens + 128) // 256)


def cosine_distances(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """1 - cosine similarity of each row of `ours` with the same row of `theirs`."""
    assert ours.shape == theirs.shape, f"{tuple(ours.shape)} vs {tuple(theirs.shape)}"
    return 1.0 - torch.nn.functional.cosine_similarity(ours.double(), theirs.double(), dim=-1)


def _model_type(model_dir: Path) -> str | None:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def _batch_sizes(text: str) -> list[int]:
    parts = [s.strip() for s in text.split(",") if s.strip()]
    if not parts or not all(s.isdigit() and int(s) > 0 for s in parts):
        raise argparse.ArgumentTypeError(f"batch sizes are positive integers separated by commas, got {text!r}")
    return [int(s) for s in parts]


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlmserve.bench.embed", description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="an embedding checkpoint directory (Qwen3-VL-Embedding's layout)")
    p.add_argument("--inputs", type=_positive, default=64, help="image+text inputs per round")
    p.add_argument("--image-size", type=_positive, default=448, help="each picture's side in pixels")
    p.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 4, 16, 64], help="transformers' batch sizes to run")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rounds", type=_positive, default=3)
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive,
        default=None,
        help="vlmserve's token budget a step (default: the engine's)",
    )
    args = p.parse_args(argv)
    model_type = _model_type(args.model)
    if model_type not in QWEN3_VL_TYPES:
        what = f"is a {model_type!r} checkpoint" if model_type else "has no config.json naming a model_type"
        p.error(
            f"{args.model} {what}; the transformers side runs Qwen3-VL-Embedding "
            f"(model_type {' or '.join(QWEN3_VL_TYPES)}): write one with vlmserve make-tiny --arch qwen3_vl "
            "--preset embedding-bench"
        )
    sizes = sorted({size for size in args.batch_sizes if size <= args.inputs})
    if not sizes:
        p.error(f"no batch size in {args.batch_sizes} is at most --inputs {args.inputs}")

    from vlmserve import LLM
    from vlmserve.bench.embed_hf import TransformersEmbedder
    from vlmserve.engine.banner import describe_device

    llm = LLM(
        args.model,
        runner="pooling",
        dtype=args.dtype,
        max_model_len=max_model_len_for(args.image_size),
        max_num_seqs=max(8, args.inputs),
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    core = llm.llm_engine.core
    hf = TransformersEmbedder(args.model, core.dtype, core.device)

    # warm up: the kernels' first calls and the allocator, vlmserve on as many inputs as
    # transformers' largest batch, transformers at each batch size it runs
    warm = embedding_inputs(max(sizes), args.image_size, seed=0)
    llm.embed(warm)
    for size in sizes:
        hf.embed(warm[:size])

    rates: dict[str, list[float]] = {"vlmserve": [], **{f"transformers batch {s}": [] for s in sizes}}
    distances: dict[str, float] = {}
    for round_index in range(args.rounds):
        inputs = embedding_inputs(args.inputs, args.image_size, seed=1 + round_index)
        start = time.perf_counter()
        outputs = llm.embed(inputs)
        rates["vlmserve"].append(len(inputs) / (time.perf_counter() - start))
        ours = torch.tensor([o.outputs.embedding for o in outputs])  # [inputs, hidden]
        for size in sizes:
            name = f"transformers batch {size}"
            start = time.perf_counter()
            # (each batch's vectors copied to the CPU: the clock waits for the device)
            theirs = torch.cat([hf.embed(inputs[i : i + size]) for i in range(0, len(inputs), size)])
            rates[name].append(len(inputs) / (time.perf_counter() - start))
            distances[name] = max(distances.get(name, 0.0), float(cosine_distances(ours, theirs).max()))

    median = {name: statistics.median(r) for name, r in rates.items()}
    best = max((name for name in median if name != "vlmserve"), key=lambda name: median[name])
    dtype = str(core.dtype).removeprefix("torch.")
    print(describe_device(core.device))
    print(
        f"{args.inputs} inputs (a {args.image_size}x{args.image_size} image and a short text each), {dtype}; "
        f"vlmserve's steps of up to {core.scheduler.config.max_num_batched_tokens} tokens"
    )
    print(f"{args.rounds} rounds, median embeddings/s:")
    for name, rate in median.items():
        rounds = ", ".join(f"{r:.2f}" for r in rates[name])
        print(f"  {name:<22} {rate:10.2f} embeddings/s  (rounds: {rounds})")
    print(f"  transformers best      {median[best]:10.2f} embeddings/s  ({best.removeprefix('transformers ')})")
    print(f"  ratio                  {median['vlmserve'] / median[best]:10.2f}x  (vlmserve / transformers best)")
    worst = max(distances, key=lambda name: distances[name])
    print(
        f"  largest cosine distance between the engines' embeddings of an input: {distances[worst]:.3g} "
        f"({worst.removeprefix('transformers ')})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
