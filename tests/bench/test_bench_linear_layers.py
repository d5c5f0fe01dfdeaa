"""`vlmserve bench` says which linear path each layer shape and row count took (bf16 on the CPU),
in bench.json and in its printed summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmserve.bench.main import main
from vlmserve.kernels.dispatch import BUCKETS


def test_bench_records_and_prints_the_linear_path_choice(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLMSERVE_CPU_PATH", "torch")  # present on every machine
    args = [str(tiny_dir), "--dtype", "bfloat16", "--no-hf", "--num-requests", "1", "--image-size", "56"]
    args += ["--input-len", "4", "--output-len", "2", "2", "--single-output-len", "2", "--threads", "2"]
    main([*args, "--concurrency", "--image-sizes", "--out", str(tmp_path)])
    linear = json.loads((tmp_path / "bench.json").read_text())["linear_layers"]
    assert linear["how"] == "forced by VLMSERVE_CPU_PATH=torch" and linear["buckets"] == [b.name for b in BUCKETS]
    assert linear["choices"] and all(set(p.values()) == {"torch"} for p in linear["choices"].values())
    hidden = json.loads((tiny_dir / "config.json").read_text())["hidden_size"]
    assert any(shape.endswith(f"x{hidden}") for shape in linear["choices"])  # the language model's layers
    out = capsys.readouterr().out
    assert "vlmserve's linear layers: forced by VLMSERVE_CPU_PATH=torch" in out
    assert "path per layer shape (out x in) and rows" in out
