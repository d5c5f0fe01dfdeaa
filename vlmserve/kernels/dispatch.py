"""Which bf16 matrix product each Linear layer of a CPU model uses, chosen once when the model is
built: per layer shape (out, in) and per row-count bucket, among the paths this machine has:

- "avx2": kernels/cpu_linear.c (AVX2 + FMA; from 96 rows on it widens the weights and runs
  torch's fp32 GEMM);
- "avx512": kernels/cpu_linear_avx512.c (AVX-512 BF16 dot products), where the CPU has avx512_bf16;
- "torch": F.linear (oneDNN, which itself uses AVX-512 BF16 / AMX where the CPU has them, and a
  slow generic kernel where it has neither).

How: `table_choice` (what measurements on this project's machines found), overridden where a
short measurement at start-up finds another path clearly faster (MEASURE_MARGIN): every
available path on a slice of each shape at one row count per bucket, the paths alternating,
fastest of a few runs, MEASURE_BUDGET_S in all (shapes left when it is spent, and layers under
MEASURE_MIN_BYTES, keep the table's choice). The margin is there because this machine is
shared: under load a parallel product's time jumps by scheduler slices (4 ms), and a close call
measured then is noise.
VLMSERVE_CPU_PATH=avx2|avx512|torch forces one path for every layer (where this machine has it;
otherwise a warning and the automatic choice); VLMSERVE_CPU_KERNELS=0 means torch only. The
choice is logged once, shown in the engine's banner, and recorded by `vlmserve bench`.

Why per bucket (issue 18; AMD EPYC Zen 4, AVX-512 BF16, 2 cores): one row streams the weights
(memory-bound: the kernel that keeps the most loads in flight wins), 8-32 rows are where
the dot-product kernels and oneDNN are close, and 33+ rows are compute-bound (oneDNN's blocked
bf16 GEMM wins; the AVX2 kernel's fp32 GEMM is half its speed).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vlmserve.kernels.op import LinearOp

if TYPE_CHECKING:
    from vlmserve.kernels.cpu import Avx512Kernels

logger = logging.getLogger(__name__)

ENV_PATH = "VLMSERVE_CPU_PATH"
PATHS = ("avx2", "avx512", "torch")


@dataclass(frozen=True)
class Bucket:
    name: str
    high: int  # the most rows in this bucket (the last one: no limit)
    rows: int  # rows the measurement uses


BUCKETS = (Bucket("1", 1, 1), Bucket("2-8", 8, 8), Bucket("9-32", 32, 32), Bucket("33+", 1 << 62, 128))
# Each measured product reads at most this many weight bytes and does at most this many flops
# (a slice of the layer's output rows): a few ms per shape, whatever the model.
MEASURE_BYTES = 4 << 20
MEASURE_FLOPS = 100e6
MEASURE_RUNS = 3
# A measured path replaces the table's choice only when it is this many times faster.
MEASURE_MARGIN = 1.5
# Smaller layers take the table's choice unmeasured: they are a small part of any step, and a
# test suite building many tiny models should not pay for measurements that decide nothing.
MEASURE_MIN_BYTES = 1 << 20
# Start-up time all measurements may take together (checked before each measurement); what is
# left when it is spent (the smallest shapes: largest first) takes table_choice.
MEASURE_BUDGET_S = 1.5


def bucket_index(rows: int) -> int:
    for i, bucket in enumerate(BUCKETS):
        if rows <= bucket.high:
            return i
    return len(BUCKETS) - 1


def available_paths() -> dict[str, LinearOp]:
    """The paths this machine can run, by name ("torch" always)."""
    from vlmserve.kernels import cpu

    ops: dict[str, LinearOp] = {}
    avx2 = cpu.load_cpu_kernels()
    if avx2 is not None:
        ops["avx2"] = avx2.linear_bf16
    avx512 = cpu.load_avx512_kernels()
    if avx512 is not None:
        ops["avx512"] = avx512.linear_bf16
    ops["torch"] = F.linear
    return ops


def forced_path() -> str | None:
    """VLMSERVE_CPU_PATH's path, None for the automatic choice (unset, empty or "auto")."""
    value = os.environ.get(ENV_PATH, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in PATHS:
        raise ValueError(f"{ENV_PATH}={value!r} is not a CPU linear path; choose one of {', '.join(PATHS)} or auto")
    return value


def build_quantized_pair(source: Path, avx512_source: Path, what: str) -> tuple[Path, Path | None, bool] | None:
    """A quantized product's shared objects for the path VLMSERVE_CPU_PATH asks for
    (forced_path): (the AVX2 one, the AVX-512 BF16 one where the CPU has it and the path
    allows it, whether decode runs them: not on the torch path); None where the AVX2 one cannot be
    built (no AVX2, no compiler, VLMSERVE_CPU_KERNELS=0). `what` names them in the log."""
    from vlmserve.kernels.cpu import AVX512_FLAGS, _build, _cpu_has_avx2, _cpu_has_avx512_bf16

    path = forced_path()
    if os.environ.get("VLMSERVE_CPU_KERNELS", "1") == "0" or not _cpu_has_avx2():
        return None
    library = _build(source)
    if library is None:
        return None
    avx512 = _build(avx512_source, AVX512_FLAGS) if path in (None, "avx512") and _cpu_has_avx512_bf16() else None
    if path == "avx512" and avx512 is None:
        logger.warning("VLMSERVE_CPU_PATH=avx512: no AVX-512 BF16 %s kernel here; using the AVX2 one", what)
    return library, avx512, path != "torch"


def avx512_kernels() -> Avx512Kernels | None:
    """The AVX-512 BF16 kernels (kernels/cpu.py's Avx512Kernels) for the attention and activations
    beside the linear layers: None where they do not build or VLMSERVE_CPU_PATH forces avx2/torch."""
    from vlmserve.kernels.cpu import load_avx512_kernels

    return load_avx512_kernels() if forced_path() in (None, "avx512") else None


def table_choice(paths: Iterable[str], bucket: Bucket) -> str:
    """The choice without a measurement (on an AMD EPYC Zen 4, docs/benchmarks.md): the AVX-512
    kernel up to 32 rows (it requests the next weight rows ahead and streams them past 8 activation
    rows at once: 2.6-4.4x faster than torch at one row, 1.6-1.7x at 8, 1.0-1.2x at 16-32, on
    layers whose weights do not fit in the caches), torch's oneDNN from 33 rows (its blocked GEMM is far ahead
    from 64); on AVX2-only CPUs the AVX2 kernel at every size (torch's bf16 product there is a
    generic ~20 GFLOP/s kernel).

    The start-up measurement rarely overrides this: its slices of the weights fit in the caches,
    where what the kernel gains by prefetching does not show."""
    paths = set(paths)
    if "avx512" in paths:
        return "avx512" if bucket.high <= 32 else "torch"
    return "avx2" if "avx2" in paths else "torch"


@dataclass
class CpuLinearDispatch:
    """A LinearOp: each call takes the path chosen for its weight's shape and its row count."""

    ops: dict[str, LinearOp]
    choices: dict[tuple[int, int], tuple[str, ...]]  # (out, in) -> a path per bucket
    how: str
    measured_ms: dict[tuple[int, int], dict[str, dict[str, float]]] = field(default_factory=dict)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = (weight.shape[0], weight.shape[1])
        paths = self.choices.get(shape)
        if paths is None:  # a shape not seen at build time (a quantized layer's dequantized slice)
            paths = self.choices[shape] = self._unmeasured()
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return self.ops[paths[bucket_index(rows)]](x, weight, bias)

    def path_for(self, shape: tuple[int, int], rows: int) -> str:
        return (self.choices.get(shape) or self._unmeasured())[bucket_index(rows)]

    def _unmeasured(self) -> tuple[str, ...]:
        if len(self.ops) == 1:  # forced
            return (next(iter(self.ops)),) * len(BUCKETS)
        return tuple(table_choice(self.ops, b) for b in BUCKETS)

    def describe(self) -> str:
        """One line: how it was chosen, and which path serves which buckets how often."""
        per_bucket = []
        for i, bucket in enumerate(BUCKETS):
            counts: dict[str, int] = {}
            for paths in self.choices.values():
                counts[paths[i]] = counts.get(paths[i], 0) + 1
            per_bucket.append(f"{bucket.name} rows: " + ", ".join(f"{p} x{n}" for p, n in sorted(counts.items())))
        return f"{self.how}; " + "; ".join(per_bucket)

    def to_json(self) -> dict[str, Any]:
        return {
            "how": self.how,
            "paths_available": sorted(self.ops),
            "buckets": [b.name for b in BUCKETS],
            "choices": {
                f"{n}x{k}": dict(zip([b.name for b in BUCKETS], paths, strict=True))
                for (n, k), paths in sorted(self.choices.items())
            },
            "measured_ms": {f"{n}x{k}": ms for (n, k), ms in sorted(self.measured_ms.items())},
        }


def _time_paths(
    ops: Mapping[str, LinearOp], x: torch.Tensor, weight: torch.Tensor, runs: int = MEASURE_RUNS
) -> dict[str, float]:
    """Fastest of `runs` calls per path, in ms, the paths alternating (the machine's load drifts)."""
    for op in ops.values():
        op(x, weight, None)  # warm-up: first-call costs, caches
    best = dict.fromkeys(ops, float("inf"))
    for _ in range(runs):
        for name, op in ops.items():
            start = time.perf_counter()
            op(x, weight, None)
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def _pick(times_ms: Mapping[str, float], table: str) -> str:
    fastest = min(times_ms, key=times_ms.__getitem__)
    return fastest if times_ms[fastest] * MEASURE_MARGIN < times_ms[table] else table


def measure(
    ops: Mapping[str, LinearOp], shapes: Iterable[tuple[int, int]], budget_s: float = MEASURE_BUDGET_S
) -> tuple[dict[tuple[int, int], tuple[str, ...]], dict[tuple[int, int], dict[str, dict[str, float]]], int]:
    """Times every path on each shape of at least MEASURE_MIN_BYTES (largest first) and bucket
    until the budget is spent. Returns the choices, the times, and how many (shape, bucket)
    pairs took table_choice for lack of time."""
    deadline = time.perf_counter() + budget_s
    choices: dict[tuple[int, int], tuple[str, ...]] = {}
    times: dict[tuple[int, int], dict[str, dict[str, float]]] = {}
    left_over = 0
    g = torch.Generator().manual_seed(0)
    weights = (0.05 * torch.randn(MEASURE_BYTES // 2, generator=g)).bfloat16()  # sliced below
    for n, k in sorted(set(shapes), key=lambda s: (-s[0] * s[1], s)):
        picked, ms = [], {}
        for bucket in BUCKETS:
            table = table_choice(ops, bucket)
            if 2 * n * k < MEASURE_MIN_BYTES:
                picked.append(table)
                continue
            if time.perf_counter() > deadline:
                picked.append(table)
                left_over += 1
                continue
            n_slice = int(max(1, min(n, MEASURE_BYTES // (2 * k), MEASURE_FLOPS // (2 * bucket.rows * k))))
            weight = weights[: n_slice * k].view(n_slice, k)
            x = torch.randn(bucket.rows, k, generator=g).bfloat16()
            times_ms = _time_paths(ops, x, weight)
            ms[bucket.name] = {p: round(t, 4) for p, t in times_ms.items()}
            picked.append(_pick(times_ms, table))
        choices[(n, k)] = tuple(picked)
        if ms:
            times[(n, k)] = ms
    return choices, times, left_over


def build_dispatch(shapes: Iterable[tuple[int, int]]) -> LinearOp:
    """The bf16 linear op for a CPU model with Linear layers of these (out, in) shapes: F.linear
    itself where torch is the only path or no shape is left to choose for (every layer on weights
    prepacked, models/prepack.py), else a CpuLinearDispatch. Logs the choice once."""
    shapes = sorted(set(shapes))
    ops = available_paths()
    if not shapes:
        return ops["torch"]
    forced = forced_path()
    if forced is not None and forced not in ops:
        logger.warning(
            "%s=%s: this machine has no %s path (the CPU lacks the feature, it did not build, or "
            "VLMSERVE_CPU_KERNELS=0); choosing among %s instead",
            ENV_PATH,
            forced,
            forced,
            ", ".join(sorted(ops)),
        )
        forced = None
    if forced is not None:
        choices = {s: (forced,) * len(BUCKETS) for s in shapes}
        dispatch = CpuLinearDispatch({forced: ops[forced]}, choices, f"forced by {ENV_PATH}={forced}")
    elif len(ops) == 1:
        return ops["torch"]
    else:
        start = time.perf_counter()
        choices, times, left_over = measure(ops, shapes)
        how = f"measured at start-up ({len(times)} shapes, {time.perf_counter() - start:.2f} s)"
        if left_over:
            how += f", {left_over} (shape, rows) pairs by table (measurement budget spent)"
        dispatch = CpuLinearDispatch(ops, choices, how, times)
    logger.info("CPU bf16 linear layers: %s", dispatch.describe())
    for (n, k), paths in sorted(dispatch.choices.items()):
        logger.debug("  %dx%d: %s", n, k, ", ".join(f"{b.name} {p}" for b, p in zip(BUCKETS, paths, strict=True)))
    return dispatch


def describe_linear_op(op: LinearOp) -> str:
    if isinstance(op, CpuLinearDispatch):
        return op.describe()
    return "torch (F.linear)" if op is F.linear else getattr(op, "__qualname__", repr(op))


def linear_op_json(op: LinearOp | None) -> dict[str, Any]:
    """What `vlmserve bench` records: the dispatch's choices and timings, or the one op."""
    if isinstance(op, CpuLinearDispatch):
        return op.to_json()
    return {"how": "none" if op is None else describe_linear_op(op)}
