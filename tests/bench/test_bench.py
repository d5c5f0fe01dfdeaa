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


def test_bench_samples_as_asked_and_compares_each_sampling_with_the_first(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [str(tiny_dir), "--dtype", "float32", "--no-hf", "--num-requests", "3", "--image-size", "56"]
    args += ["--input-len", "4", "--output-len", "6", "6", "--single-output-len", "3", "--threads", "2"]
    args += ["--concurrency", "--image-sizes", "--out", str(tmp_path)]
    main(
        [*args, "--sampling", "greedy", "checkpoint", "temperature=1.5,top_k=50,top_p=1.0,presence_penalty=0.5"]
        + ["checkpoint+json"]
    )
    report = json.loads((tmp_path / "bench.json").read_text())
    # The tiny checkpoint carries Qwen2-VL's published generation_config.json; values go on top.
    assert report["sampling"] == {
        "greedy": {"temperature": 0.0},
        "checkpoint": {"repetition_penalty": 1.0, "temperature": 0.01, "top_k": 1, "top_p": 0.001},
        "temperature=1.5,top_k=50,top_p=1.0,presence_penalty=0.5": {
            "repetition_penalty": 1.0,
            "temperature": 1.5,
            "top_k": 50,
            "top_p": 1.0,
            "presence_penalty": 0.5,
        },
        "checkpoint+json": {
            "repetition_penalty": 1.0,
            "temperature": 0.01,
            "top_k": 1,
            "top_p": 0.001,
            "json_schema": True,
        },
    }
    by_sampling = report["results"]["vlmserve"]["workload_by_sampling"]
    assert [r["sampling"] for r in by_sampling["rows"]] == list(report["sampling"])
    assert by_sampling["rows"][0]["x_first"] == 1.0 and all(r["useful_tokens_per_s"] > 0 for r in by_sampling["rows"])
    greedy = [r["token_ids"] for r in report["results"]["vlmserve"]["workload"]["requests"]]
    runs = by_sampling["runs"]
    # Qwen2-VL's top_k 1 is the argmax: greedy's tokens; the values sample (a random tiny model's
    # flat distribution: 18 tokens all equal to greedy's would be a draw that does not happen).
    assert [r["token_ids"] for r in runs["checkpoint"]["requests"]] == greedy
    sampled = runs["temperature=1.5,top_k=50,top_p=1.0,presence_penalty=0.5"]["requests"]
    assert [r["token_ids"] for r in sampled] != greedy and all(len(r["token_ids"]) == 6 for r in sampled)
    # Under a JSON schema each request's answer starts as its schema allows: an object.
    texts = [llm_text(tiny_dir, r["token_ids"]) for r in runs["checkpoint+json"]["requests"]]
    assert all(t.startswith("{") for t in texts), texts
    assert "workload by sampling" in capsys.readouterr().out


def llm_text(model_dir: Path, token_ids: list[int]) -> str:
    from vlmserve.registry import family_of, load_model_config

    tokenizer = family_of(load_model_config(model_dir / "config.json")).load_tokenizer(model_dir)
    return tokenizer.decode(token_ids)


def test_sampling_specs_are_checked_and_transformers_samples_the_same_way() -> None:
    import argparse

    from vlmserve.bench.sampling import hf_generate_kwargs, sampling_fields, sampling_spec

    assert sampling_spec("temperature=0.7,top_k=20") == "temperature=0.7,top_k=20"
    assert sampling_spec("greedy+json") == "greedy+json"
    for bad in ("temp=0.7", "top_k=two", "temperature"):
        with pytest.raises(argparse.ArgumentTypeError, match="sampling spec|takes a"):
            sampling_spec(bad)
    qwen25 = {"temperature": 0.01, "top_k": 1, "top_p": 0.001, "repetition_penalty": 1.05, "max_tokens": 512}
    assert sampling_fields("checkpoint", qwen25) == {k: v for k, v in qwen25.items() if k != "max_tokens"}
    assert sampling_fields("top_p=0.9", qwen25)["top_p"] == 0.9
    assert hf_generate_kwargs(sampling_fields("checkpoint", qwen25)) == {
        "do_sample": True,
        "temperature": 0.01,
        "top_k": 1,
        "top_p": 0.001,
        "min_p": None,
        "repetition_penalty": 1.05,
    }
    # greedy keeps the checkpoint's repetition penalty from sneaking in through generation_config.json
    assert hf_generate_kwargs({"temperature": 0.0})["repetition_penalty"] == 1.0
    with pytest.raises(ValueError, match="no json_schema"):
        hf_generate_kwargs(sampling_fields("greedy+json", qwen25))
    with pytest.raises(ValueError, match="no presence_penalty"):
        hf_generate_kwargs({"temperature": 0.7, "presence_penalty": 1.5})
