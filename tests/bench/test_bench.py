"""`vlmserve bench` end to end at toy sizes: both engines run the same requests and generate
the same greedy tokens (float32), every request exactly its output length, and the report
files are written."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from vlmserve.bench.main import main


def test_bench_engines_generate_the_same_greedy_tokens_and_reports_are_written(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    main(
        [
            str(tiny_dir),
            "--dtype",
            "float32",
            "--num-requests",
            "4",
            "--image-size",
            "56",
            "--input-len",
            "6",
            "--output-len",
            "3",
            "7",
            "--single-output-len",
            "5",
            "--single-rounds",
            "2",
            "--hf-batch-sizes",
            "1",
            "2",
            "--concurrency",
            "1",
            "3",
            "--sweep-requests",
            "3",
            "--sweep-output-len",
            "2",
            "3",
            "--image-sizes",
            "56",
            "84",
            "--sweep-hf",
            "--threads",
            "2",
            "--out",
            str(out),
        ]
    )
    report = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 10_000
    ours = report["results"]["vlmserve"]["workload"]
    theirs = report["results"]["transformers"]["workload"]
    lengths = [r["output_tokens"] for r in ours["requests"]]
    assert lengths == [r["output_tokens"] for r in theirs["requests"]]
    assert all(3 <= n <= 7 for n in lengths) and ours["summary"]["output_tokens"] == sum(lengths)
    # The same requests through both engines, greedy, float32: the same tokens, so the timings
    # compare like with like (an engine producing other tokens is not faster, it is wrong).
    tokens = [r["token_ids"] for r in ours["requests"]]
    assert tokens == [r["token_ids"] for r in theirs["requests"]]
    assert [len(t) for t in tokens] == lengths
    assert len({tuple(t) for t in tokens}) == len(tokens)  # the requests (random images and words) differ
    assert report["greedy_agreement"] == {"requests": 4, "identical": 4, "tokens_before_first_difference": lengths}
    for r in ours["requests"]:
        assert r["submitted"] <= r["first_token"] <= r["finished"]
    assert theirs["summary"]["batch_size"] in (1, 2)
    assert set(report["results"]["transformers"]["batch_size_probe"]) == {"1", "2"}
    assert len(report["results"]["vlmserve"]["single"]) == len(report["results"]["transformers"]["single"]) == 2
    assert len(report["single_rounds"]["decode_step_ratios"]) == 2
    assert "useful_tokens_per_s" in report["ratios"]
    sweeps = report["results"]["sweeps"]
    assert [r["concurrency"] for r in sweeps["concurrency"] if r["engine"] == "vlmserve"] == [1, 3]
    assert [r["image_tokens"] for r in sweeps["image_size"] if r["engine"] == "vlmserve"] == [4, 9]


def test_bench_without_transformers_or_sweeps_prints_its_tables_and_phases(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    args = [str(tiny_dir), "--dtype", "float32", "--no-hf", "--num-requests", "2", "--image-size", "56"]
    args += ["--input-len", "4", "--output-len", "2", "3", "--single-output-len", "3", "--threads", "2"]
    with caplog.at_level(logging.INFO, logger="vlmserve"):
        main([*args, "--concurrency", "--image-sizes", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "\nworkload\n" in out and "\none request alone\n" in out
    phases = [r.getMessage() for r in caplog.records if r.name == "vlmserve.bench.main"]
    assert [p.split(" (")[0] for p in phases] == [
        "phase 1 of 3: vlmserve: loading the model",
        "phase 2 of 3: vlmserve: the workload",
        "phase 3 of 3: vlmserve: one request alone",
    ]
    # Each measured run shows its progress in output tokens, to the last one.
    progress = [r.getMessage() for r in caplog.records if r.name == "vlmserve.bench.run_vlmserve"]
    assert any(line.startswith("vlmserve workload: 5/5 tokens (100%)") for line in progress), progress
