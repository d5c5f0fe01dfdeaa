"""The AVX-512 BF16 linear kernel (cpu_linear_avx512.c) against the fp32 product, and the choice
among the CPU bf16 paths (kernels/dispatch.py): the table, the measurement's rule, the forced
paths (VLMSERVE_CPU_PATH), the fallbacks where the CPU lacks a feature (a fake /proc/cpuinfo),
and the routing of each call by weight shape and row count.

The kernel's tests skip (saying why) only where this CPU lacks AVX-512 BF16 or nothing can be
compiled; a machine that has both and fails to build it is a failure."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from unittest.mock import ANY

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.guard import before_guard_page
from vlmserve.kernels import cpu, dispatch, select_linear_op
from vlmserve.kernels.dispatch import BUCKETS, CpuLinearDispatch, build_dispatch, describe_linear_op, table_choice


def _why_no_avx512() -> str | None:
    if os.environ.get("VLMSERVE_CPU_KERNELS", "1") == "0":
        return "VLMSERVE_CPU_KERNELS=0"
    if not cpu._cpu_has_avx512_bf16():
        return "this CPU lacks AVX-512 F/BW/BF16 (avx512_bf16 not in /proc/cpuinfo)"
    if (shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")) is None:
        return "no C compiler (cc or gcc)"
    return None


CANNOT_BUILD = _why_no_avx512()
avx512 = cpu.load_avx512_kernels()
needs_avx512 = pytest.mark.skipif(
    avx512 is None, reason=f"no AVX-512 BF16 kernel: {CANNOT_BUILD or 'the build failed (see the build test)'}"
)

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c bmi2\n"
AVX512 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16\n"


def test_avx512_kernel_builds_where_the_cpu_and_a_compiler_allow() -> None:
    if CANNOT_BUILD is not None:
        print(f"skipped: {CANNOT_BUILD}")
        pytest.skip(f"the AVX-512 kernel cannot be built here: {CANNOT_BUILD}")
    assert avx512 is not None, "AVX-512 BF16 and a C compiler are present, yet the kernel did not build"


# -- the kernel --------------------------------------------------------------------------------------

# in (k) not a multiple of 32 (the masked tail) or below 32; out (n) not a multiple of the 8 / 4
# weight rows a tile takes; rows 1..40 and past one 64-row block.
SHAPES = [(7, 13), (33, 97), (130, 1176), (1027, 200), (9, 64)]
ROWS = [1, 2, 3, 4, 5, 8, 9, 17, 31, 32, 33, 40, 67]


def _check_rounded_once(out: torch.Tensor, reference: torch.Tensor) -> None:
    # Only the summation order differs from the fp32 reference: within one bf16 step of it, and
    # nearly always the reference rounded once (truncating, or a tail left out, misses far more).
    ulp = reference.abs().clamp(min=1e-3) * 2.0**-7
    assert ((out.float() - reference).abs() <= ulp).all()
    assert (out.float() == reference.bfloat16().float()).float().mean() > 0.98


@needs_avx512
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_avx512_kernel_matches_the_fp32_product(n: int, k: int, with_bias: bool) -> None:
    assert avx512 is not None
    g = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    for m in ROWS:
        x = torch.randn(m, k, generator=g).bfloat16()
        reference = F.linear(x.float(), w.float(), None if b is None else b.float())
        out = avx512.linear_bf16(x, w, b)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        _check_rounded_once(out, reference)


@needs_avx512
@pytest.mark.parametrize("rows", [1, 5])
def test_avx512_kernel_reads_nothing_past_the_weights(rows: int) -> None:
    assert avx512 is not None
    x = torch.randn(rows, 45).bfloat16()
    w = before_guard_page(torch.randn(9, 45).bfloat16())  # a partial 32-wide chunk at the very end
    _check_rounded_once(avx512.linear_bf16(x, w, None), F.linear(x.float(), w.float()))


@needs_avx512
def test_avx512_kernel_takes_leading_dims_and_strided_inputs() -> None:
    assert avx512 is not None
    x = torch.randn(2, 3, 5, 80).bfloat16()[..., ::2]  # [2, 3, 5, 40], strided
    w = torch.randn(24, 40).bfloat16()
    out = avx512.linear_bf16(x, w, None)
    assert out.shape == (2, 3, 5, 24)
    _check_rounded_once(out, F.linear(x.float(), w.float()))


# -- the choice ---------------------------------------------------------------------------------------


def test_table_prefers_avx512_up_to_32_rows_and_torch_above_and_avx2_without_avx512() -> None:
    assert [table_choice({"avx2", "avx512", "torch"}, b) for b in BUCKETS] == ["avx512"] * 3 + ["torch"]
    assert [table_choice({"avx2", "torch"}, b) for b in BUCKETS] == ["avx2"] * 4
    assert [table_choice({"torch"}, b) for b in BUCKETS] == ["torch"] * 4


def test_rows_fall_in_their_buckets() -> None:
    assert [dispatch.bucket_index(r) for r in (0, 1, 2, 8, 9, 32, 33, 4096)] == [0, 0, 1, 1, 2, 2, 3, 3]


class Recorder:
    """A path that says it was called (by name) and returns F.linear's result."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        self.calls.append(self.name)
        return F.linear(x, w, b)


def test_each_call_takes_its_shape_and_buckets_path() -> None:
    calls: list[str] = []
    ops = {p: Recorder(p, calls) for p in ("avx2", "avx512", "torch")}
    choices = {(6, 4): ("avx512", "avx2", "torch", "avx2"), (5, 4): ("torch", "torch", "avx512", "avx512")}
    op = CpuLinearDispatch(ops, choices, "test")  # type: ignore[arg-type]
    w6, w5 = torch.randn(6, 4), torch.randn(5, 4)
    for rows in (1, 5, 20, 100):
        op(torch.randn(rows, 4), w6, None)
    assert calls == ["avx512", "avx2", "torch", "avx2"]
    calls.clear()
    out = op(torch.randn(2, 3, 4), w5, None)  # 6 rows in leading dims: bucket 2-8
    op(torch.randn(1, 10, 4), w5, None)  # 10 rows
    assert calls == ["torch", "avx512"] and out.shape == (2, 3, 5)
    calls.clear()
    op(torch.randn(1, 4), torch.randn(7, 4), None)  # a shape not chosen for: the table's choice
    assert calls == ["avx512"] and op.choices[(7, 4)] == ("avx512", "avx512", "avx512", "torch")


@pytest.fixture
def fake_paths(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """All three paths present, as recorders; the environment clean."""
    calls: list[str] = []
    monkeypatch.setattr(dispatch, "available_paths", lambda: {p: Recorder(p, calls) for p in dispatch.PATHS})
    monkeypatch.delenv("VLMSERVE_CPU_PATH", raising=False)
    yield calls


@pytest.mark.parametrize("path", ["avx2", "avx512", "torch"])
def test_forcing_a_path_uses_it_for_every_shape_and_row_count(
    path: str, fake_paths: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("VLMSERVE_CPU_PATH", path.upper())
    with caplog.at_level(logging.INFO, logger="vlmserve.kernels.dispatch"):
        op = build_dispatch([(6, 4), (3, 4)])
    assert isinstance(op, CpuLinearDispatch)
    assert op.choices == {(6, 4): (path,) * 4, (3, 4): (path,) * 4}
    for rows in (1, 8, 32, 300):
        op(torch.randn(rows, 4), torch.randn(6, 4), None)
    op(torch.randn(1, 4), torch.randn(9, 4), None)  # unseen shape: still the forced path
    assert fake_paths == [path] * 5
    assert [r.getMessage() for r in caplog.records] == [
        f"CPU bf16 linear layers: forced by VLMSERVE_CPU_PATH={path}; "
        + "; ".join(f"{b.name} rows: {path} x2" for b in BUCKETS)
    ]
    assert op.to_json()["choices"]["6x4"] == {b.name: path for b in BUCKETS}
    assert describe_linear_op(op) == op.describe() and describe_linear_op(F.linear) == "torch (F.linear)"


@needs_avx512
@pytest.mark.parametrize("path", ["avx2", "avx512", "torch"])
def test_each_forced_path_runs_the_real_product(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLMSERVE_CPU_PATH", path)
    op = select_linear_op(torch.device("cpu"), torch.bfloat16, [(40, 72)])
    assert isinstance(op, CpuLinearDispatch) and list(op.ops) == [path]
    if path == "torch":
        assert op.ops[path] is F.linear
    else:  # a bound method of the kernel object
        assert isinstance(
            getattr(op.ops[path], "__self__", None), {"avx2": cpu.CpuKernels, "avx512": cpu.Avx512Kernels}[path]
        )
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(40, 72, generator=g).bfloat16(), torch.randn(40, generator=g).bfloat16()
    for rows in (1, 7, 30, 100):
        x = torch.randn(rows, 72, generator=g).bfloat16()
        _check_rounded_once(op(x, w, b), F.linear(x.float(), w.float(), b.float()))


def test_an_unknown_path_is_an_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLMSERVE_CPU_PATH", "avx9000")
    with pytest.raises(ValueError, match=r"VLMSERVE_CPU_PATH='avx9000'.*avx2, avx512, torch"):
        build_dispatch([(6, 4)])


def test_measurement_overrides_the_table_only_when_clearly_faster(
    fake_paths: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Per bucket: (avx2, avx512, torch) ms as measured.
    measured = iter(
        [
            (1.0, 2.0, 3.0),  # avx2 2x faster than the table's avx512: taken
            (1.0, 1.1, 3.0),  # avx2 faster, but within the margin: the table's avx512
            (3.0, 2.0, 1.0),  # torch 2x faster than the table's avx512: taken
            (1.0, 3.0, 1.1),  # avx2 faster than the table's torch, within the margin: torch
        ]
    )
    seen: list[tuple[int, ...]] = []

    def fake_time(ops: dict[str, object], x: torch.Tensor, weight: torch.Tensor) -> dict[str, float]:
        seen.append((x.shape[0], *weight.shape))
        return dict(zip(("avx2", "avx512", "torch"), next(measured), strict=True))

    monkeypatch.setattr(dispatch, "_time_paths", fake_time)
    op = build_dispatch([(512, 1024), (6, 4)])  # 1 MiB of bf16 weights: measured; (6, 4): too small
    assert isinstance(op, CpuLinearDispatch)
    assert op.choices == {(512, 1024): ("avx2", "avx512", "torch", "torch"), (6, 4): ("avx512",) * 3 + ("torch",)}
    assert [s[0] for s in seen] == [b.rows for b in BUCKETS]
    assert [s[1:] for s in seen] == [(512, 1024)] * 3 + [(int(dispatch.MEASURE_FLOPS // (2 * 128 * 1024)), 1024)]
    assert op.to_json()["measured_ms"] == {"512x1024": {b.name: ANY for b in BUCKETS}}
    assert op.to_json()["measured_ms"]["512x1024"]["1"] == {"avx2": 1.0, "avx512": 2.0, "torch": 3.0}


def test_measurement_slices_big_layers_and_stops_when_its_budget_is_spent(
    fake_paths: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, int, int]] = []
    clock = iter(range(0, 1000))  # each perf_counter call: one more second

    def fake_time(ops: dict[str, object], x: torch.Tensor, weight: torch.Tensor) -> dict[str, float]:
        seen.append((x.shape[0], *weight.shape))
        return {"avx2": 1.0, "avx512": 1.0, "torch": 1.0}

    monkeypatch.setattr(dispatch, "_time_paths", fake_time)
    monkeypatch.setattr(dispatch, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    shapes = [(512, 1024), (151936, 1536)]
    choices, times, left_over = dispatch.measure(dispatch.available_paths(), shapes, budget_s=4.5)
    # The largest shape first, on a slice within MEASURE_BYTES and MEASURE_FLOPS; then the budget
    # (4.5 "seconds": the deadline is read at 0, then the clock before each bucket) runs out.
    assert seen[0] == (1, dispatch.MEASURE_BYTES // (2 * 1536), 1536)
    assert seen[3] == (128, int(dispatch.MEASURE_FLOPS // (2 * 128 * 1536)), 1536)
    assert len(seen) == 4 and list(times) == [(151936, 1536)]
    assert left_over == 4 and choices[(512, 1024)] == ("avx512", "avx512", "avx512", "torch")


# -- what this machine has ------------------------------------------------------------------------------


def test_cpu_feature_check_needs_avx512_f_bw_and_bf16(tmp_path: Path) -> None:
    def has(flags: str) -> bool:
        (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n")
        return cpu._cpu_has_avx512_bf16(tmp_path / "cpuinfo")

    assert has("avx2 avx512f avx512bw avx512_bf16")
    assert not has("avx2 avx512f avx512bw avx512_vnni")  # no bf16
    assert not has("avx2 avx512f avx512_bf16")  # no bw
    assert not has("avx2 avx512bw avx512_bf16")  # no f
    assert not cpu._cpu_has_avx512_bf16(tmp_path / "missing")


@pytest.fixture
def fake_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The loaders un-cached and reading a fake /proc/cpuinfo (write it before loading)."""
    path = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpu, "CPUINFO", path)
    monkeypatch.delenv("VLMSERVE_CPU_KERNELS", raising=False)
    monkeypatch.delenv("VLMSERVE_CPU_PATH", raising=False)
    cpu.load_cpu_kernels.cache_clear()
    cpu.load_avx512_kernels.cache_clear()
    yield path
    cpu.load_cpu_kernels.cache_clear()
    cpu.load_avx512_kernels.cache_clear()


def test_forcing_avx512_on_an_avx2_only_cpu_warns_and_chooses_among_the_rest(
    fake_cpu: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_cpu.write_text(AVX2_ONLY)
    assert cpu.load_avx512_kernels() is None
    avx2 = cpu.load_cpu_kernels()
    if avx2 is None:
        pytest.skip("the AVX2 kernels cannot be built here")
    monkeypatch.setenv("VLMSERVE_CPU_PATH", "avx512")
    with caplog.at_level(logging.INFO, logger="vlmserve.kernels.dispatch"):
        op = build_dispatch([(40, 72)])
    assert isinstance(op, CpuLinearDispatch) and set(op.ops) == {"avx2", "torch"}
    assert "VLMSERVE_CPU_PATH=avx512: this machine has no avx512 path" in caplog.text
    assert all(p in ("avx2", "torch") for p in op.choices[(40, 72)])


def test_avx2_path_works_with_avx512_disabled(fake_cpu: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU reporting AVX2 only, forcing avx2 runs the AVX2 kernel (today's path) for every
    row count: the right products, and no AVX-512 kernel loaded."""
    fake_cpu.write_text(AVX2_ONLY)
    if cpu.load_cpu_kernels() is None:
        pytest.skip("the AVX2 kernels cannot be built here")
    monkeypatch.setenv("VLMSERVE_CPU_PATH", "avx2")
    op = select_linear_op(torch.device("cpu"), torch.bfloat16, [(40, 72)])
    assert isinstance(op, CpuLinearDispatch) and list(op.ops) == ["avx2"]
    assert cpu.load_avx512_kernels() is None
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, 72, generator=g).bfloat16(), torch.randn(40, generator=g).bfloat16()
    for rows in (1, 7, 30, 100):
        x = torch.randn(rows, 72, generator=g).bfloat16()
        _check_rounded_once(op(x, w, b), F.linear(x.float(), w.float(), b.float()))


def test_all_three_paths_where_the_cpu_has_avx512_bf16(fake_cpu: Path) -> None:
    fake_cpu.write_text(AVX512)
    if CANNOT_BUILD is not None:
        pytest.skip(f"the AVX-512 kernel cannot be built here: {CANNOT_BUILD}")
    assert set(dispatch.available_paths()) == {"avx2", "avx512", "torch"}
    fake_cpu.write_text(AVX2_ONLY)
    cpu.load_avx512_kernels.cache_clear()
    assert set(dispatch.available_paths()) == {"avx2", "torch"}


def test_kernels_off_means_torch_only(fake_cpu: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu.write_text(AVX512)
    monkeypatch.setenv("VLMSERVE_CPU_KERNELS", "0")
    monkeypatch.setenv("VLMSERVE_CPU_PATH", "avx512")  # asks for what is switched off: torch still
    assert select_linear_op(torch.device("cpu"), torch.bfloat16, [(40, 72)]) is F.linear
    fake_cpu.write_text("processor\t: 0\nflags\t\t: fpu sse2\n")  # and a CPU without AVX2
    monkeypatch.delenv("VLMSERVE_CPU_KERNELS")
    cpu.load_cpu_kernels.cache_clear()
    cpu.load_avx512_kernels.cache_clear()
    assert select_linear_op(torch.device("cpu"), torch.bfloat16, [(40, 72)]) is F.linear
