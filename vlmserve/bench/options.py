"""`vlmserve bench`'s options (standard library only: checked before torch is imported)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from vlmserve.arg_types import positive_int
from vlmserve.bench.sampling import sampling_spec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="checkpoint directory or hub id (default: the benchmark-size random Qwen2-VL, written on first use)",
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"], help="both engines' dtype"
    )
    p.add_argument("--num-requests", type=positive_int, default=32, help="requests in the workload")
    p.add_argument("--image-size", type=positive_int, default=448, help="square images of this side, in pixels")
    p.add_argument("--input-len", type=positive_int, default=64, help="text words per prompt (about one token each)")
    p.add_argument(
        "--output-len",
        type=positive_int,
        nargs=2,
        default=[32, 256],
        metavar=("MIN", "MAX"),
        help="output tokens per request, spread over MIN..MAX",
    )
    p.add_argument(
        "--single-output-len", type=positive_int, default=64, help="tokens for the single-request decode timing"
    )
    p.add_argument(
        "--single-rounds",
        type=positive_int,
        default=3,
        help="one-request timings alternate between the engines this many times (medians reported)",
    )
    p.add_argument(
        "--hf-batch-sizes",
        type=positive_int,
        nargs="+",
        default=[1, 2, 4, 8, 16, 32],
        metavar="N",
        help="static batch sizes transformers is probed at (the best one runs the workload)",
    )
    p.add_argument(
        "--sampling",
        type=sampling_spec,
        nargs="+",
        default=["checkpoint"],
        metavar="SPEC",
        help="how requests sample: 'checkpoint' (the checkpoint's generation_config.json, what a request that "
        "sets no sampling field gets; the default), 'greedy', or values on top of the checkpoint's such as "
        "temperature=0.7,top_k=20,top_p=0.8; '+json' after any: each request follows its own "
        "JSON schema. Several: vlmserve runs the workload once with each (ratios to the "
        "first); transformers, the one-request rounds and the sweeps take the first",
    )
    p.add_argument("--no-hf", action="store_true", help="skip transformers: vlmserve's numbers only")
    p.add_argument(
        "--single",
        action="store_true",
        help="only one request alone (--single-rounds rounds alternating the engines): decode step, time to "
        "first token, and the read bandwidth measured in each round with the step's share of its limit",
    )
    p.add_argument(
        "--quantization",
        choices=["int8"],
        default=None,
        help="vlmserve's weight-only quantization (transformers stays at --dtype)",
    )
    p.add_argument(
        "--hf-model",
        type=Path,
        default=None,
        metavar="DIR",
        help="the checkpoint transformers runs (default: vlmserve's): e.g. the float checkpoint an AWQ one "
        "was made from (vlmserve.tools.quantize_awq), as transformers runs AWQ only through extra packages",
    )
    p.add_argument(
        "--concurrency",
        type=positive_int,
        nargs="*",
        default=[1, 4, 16, 64],
        metavar="N",
        help="concurrency sweep: requests in flight at each level (none: skip the sweep)",
    )
    p.add_argument("--sweep-requests", type=positive_int, default=64, help="requests at each sweep level")
    p.add_argument(
        "--sweep-output-len",
        type=positive_int,
        nargs=2,
        default=[16, 48],
        metavar=("MIN", "MAX"),
        help="output tokens per sweep request",
    )
    p.add_argument(
        "--image-sizes",
        type=positive_int,
        nargs="*",
        default=[224, 448, 672, 896],
        metavar="PX",
        help="image size sweep: square sides in pixels (none: skip the sweep)",
    )
    p.add_argument("--sweep-hf", action="store_true", help="run the sweeps through transformers too")
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for bench.json and bench.png")
