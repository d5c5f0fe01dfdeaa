"""`python -m vlmserve.bench.kernels`: the CPU bf16 linear paths (kernels/dispatch.py: the AVX2
kernel, the AVX-512 BF16 kernel, torch's F.linear; and "packed": the weight reordered once for
oneDNN, read by vlmserve's AVX-512 kernel up to PACKED_ROWS rows, oneDNN's product past that,
kernels/onednn.py's packed_linear) on Qwen2-VL-2B's decode shapes, for 1, 8 and 32 rows (--rows to
change), with the path a bf16 model built here takes ("auto": packed where models/prepack.py
reorders the layer, else the dispatch's choice; the 2B's lm_head is tied to its embedding, so plain).

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
from vlmserve.kernels.dispatch import BUCKETS, available_paths, avx512_kernels, build_dispatch, forced_path
from vlmserve.kernels.onednn import packed_layout, packed_linear, prepack_available, reorder_weight

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
    packs = prepack_available() and avx512_kernels() is not None and forced_path() is None
    if packs:
        ops["packed"] = packed_linear
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
        packed = packs and packed_layout(n, k)
        reordered = [reorder_weight(w) for w in weights] if packed else []
        shape_ops = {p: op for p, op in ops.items() if p != "packed" or packed}
        for m in args.rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            times: dict[str, list[float]] = {p: [] for p in shape_ops}
            for _ in range(args.rounds):
                for path, op in shape_ops.items():
                    mats = reordered if path == "packed" else weights
                    op(x, mats[0], None)  # warm-up
                    times[path].append(_per_matrix(op, x, mats))
            med = {path: statistics.median(ts) for path, ts in times.items()}
            cells = " ".join(
                f"{med[p] * 1e3:9.3f} ({med['torch'] / med[p]:4.2f}x)" if p in med else f"{'-':>16}" for p in ops
            )
            auto = "packed" if packed and name != "lm_head" else choose((n, k), m)
            print(f"{name:>13} {m:4d} {cells} {auto:>7}")
        del weights, reordered
    print("buckets: " + ", ".join(b.name for b in BUCKETS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
