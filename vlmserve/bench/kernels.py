"""`python -m vlmserve.bench.kernels`: the CPU bf16 linear kernel against torch's F.linear on the
benchmark model's shapes, for 1 to 64 rows."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from vlmserve.bench.metrics import median_seconds
from vlmserve.kernels.cpu import load_cpu_kernels

SHAPES = {"lm_head": (151936, 1536), "gate_up_proj": (17920, 1536), "down_proj": (1536, 8960), "qkv_proj": (2048, 1536)}


def main() -> int:
    torch.set_num_threads(os.cpu_count() or 1)
    kernels = load_cpu_kernels()
    if kernels is None:
        print("the CPU kernels are not available here (no AVX2/FMA/F16C, no compiler, or VLMSERVE_CPU_KERNELS=0)")
        return 1
    print(f"{'matrix':>13} {'rows':>4} {'vlmserve ms':>11} {'GB/s':>6} {'GFLOP/s':>8} {'torch ms':>9} {'speed-up':>8}")
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k).bfloat16()
        for m in (1, 8, 32, 64):
            x = torch.randn(m, k).bfloat16()
            ours = median_seconds(functools.partial(kernels.linear_bf16, x, weight, None), 7)
            theirs = median_seconds(functools.partial(F.linear, x, weight), 3)
            gb = weight.numel() * 2 / ours / 1e9
            gflops = 2 * m * n * k / ours / 1e9
            row = f"{name:>13} {m:4d} {ours * 1e3:11.2f} {gb:6.1f} {gflops:8.1f}"
            print(f"{row} {theirs * 1e3:9.2f} {theirs / ours:7.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
