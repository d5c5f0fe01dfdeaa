"""`python -m vlmserve.bench.kernels`: the CPU bf16 linear paths (kernels/dispatch.py: the AVX2
kernel, the AVX-512 BF16 kernel, torch's F.linear) on Qwen2-VL-2B's decode shapes, for 1, 8 and
32 rows (--rows to change), with the path the automatic choice (`build_dispatch`) takes.

Each timing runs over enough copies of the matrix (--stream-mb in all) that the weights come
from memory, as a decode step's do, not from the caches; the time shown is per matrix. The
paths alternate within every round (the machine's load drifts): medians of --rounds rounds, and
each path's time relative to torch's from the same rounds."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from vlmserve.engine.banner import describe_cpu
from vlmserve.kernels import LinearOp
from vlmserve.kernels.dispatch import BUCKETS, available_paths, build_dispatch

SHAPES = {
    "qkv_proj": (2048, 1536),
    "o_proj": (1536, 1536),
    "gate_up_proj": (17920, 1536),
    "down_proj": (1536, 8960),
    "lm_head": (151936, 1536),
}


def _per_matrix(op: LinearOp, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in weights:
        op(x, w, None)
    return (time.perf_counter() - start) / len(weights)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlmserve.bench.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--stream-mb", type=int, default=128, help="weight bytes each timing streams")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    print(describe_cpu())
    ops = available_paths()
    dispatch = build_dispatch([SHAPES[s] for s in args.shapes])
    choose = getattr(dispatch, "path_for", lambda shape, rows: "torch")
    print(f"paths here: {', '.join(ops)}; automatic choice: {getattr(dispatch, 'how', 'torch only')}")
    print(f"median of {args.rounds} alternating rounds, ms per matrix; (x): torch's time / this path's")
    header = f"{'matrix':>13} {'rows':>4} " + " ".join(f"{p + ' ms':>16}" for p in ops) + f" {'auto':>7}"
    print(header)
    g = torch.Generator().manual_seed(0)
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = max(1, (args.stream_mb << 20) // (2 * n * k))
        weights = [(0.05 * torch.randn(n, k, generator=g)).bfloat16() for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            times: dict[str, list[float]] = {p: [] for p in ops}
            for op in ops.values():
                op(x, weights[0], None)  # warm-up
            for _ in range(args.rounds):
                for path, op in ops.items():
                    times[path].append(_per_matrix(op, x, weights))
            med = {path: statistics.median(ts) for path, ts in times.items()}
            cells = " ".join(f"{med[p] * 1e3:9.3f} ({med['torch'] / med[p]:4.2f}x)" for p in ops)
            print(f"{name:>13} {m:4d} {cells} {choose((n, k), m):>7}")
        del weights
    print("buckets: " + ", ".join(b.name for b in BUCKETS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
