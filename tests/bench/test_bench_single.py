"""`vlmserve bench --single` (one request, alternating rounds, the read-bandwidth limit measured
in each round) and what the vLLM comparison hands vLLM: prompts that are the same prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from vlmserve.bench.main import main
from vlmserve.bench.single import decode_weight_bytes
from vlmserve.bench.vllm_cpu import _prompt_text
from vlmserve.bench.workload import make_workload
from vlmserve.entrypoints.llm import LLM

ARGS = ["--single", "--image-size", "56", "--input-len", "4", "--single-output-len", "5", "--threads", "2"]


def _language_model_bytes(model_dir: Path, itemsize: int) -> int:
    """What one decode step reads, counted from the checkpoint's own tensors: all but the vision
    tower and the embedding table, plus the table once more when lm_head is tied to it."""
    config = json.loads((model_dir / "config.json").read_text())
    total = 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        for name in names:
            numel = f.get_slice(name).get_shape()
            count = int(torch.tensor(numel).prod())
            if name.startswith("visual") or "embed_tokens" in name:
                if "embed_tokens" in name and config.get("tie_word_embeddings") and "lm_head.weight" not in names:
                    total += count * itemsize
                continue
            total += count * itemsize
    return total


def test_decode_weight_bytes_counts_the_language_model_and_a_tied_head_once(tiny_dir: Path) -> None:
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=256)
    assert decode_weight_bytes(llm.llm_engine.model) == _language_model_bytes(tiny_dir, 4)


def test_single_reports_the_bandwidth_limit_and_both_engines_in_alternating_rounds(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main([str(tiny_dir), "--dtype", "float32", *ARGS, "--single-rounds", "2", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "bench.json").read_text())["single"]
    assert report["weight_bytes_per_step"] == _language_model_bytes(tiny_dir, 4)
    step_bytes = report["weight_bytes_per_step"] + report["kv_bytes_per_step"]
    assert report["kv_bytes_per_step"] > 0
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    for row, ours, theirs in zip(report["rounds"], report["vlmserve"], report["transformers"], strict=True):
        assert row["read_GBps"] > 0.1
        # limit = the step's bytes at the bandwidth measured in that round; the share of it
        # the step reached = limit / step
        assert row["limit_ms"] == pytest.approx(step_bytes / (row["read_GBps"] * 1e9) * 1e3, rel=0.01, abs=0.06)
        step = ours["summary"]["tpot_mean_s"]
        assert row["of_limit_%"] == pytest.approx(100 * step_bytes / (row["read_GBps"] * 1e9) / step, rel=0.02)
        assert row["vlmserve_step_ms"] == pytest.approx(ours["summary"]["tpot_mean_s"] * 1e3, abs=0.06)
        assert row["decode_x"] == pytest.approx(row["transformers_step_ms"] / row["vlmserve_step_ms"], rel=0.05)
        # the same request, greedy, float32: the same 5 tokens from both engines
        (mine,), (hf,) = ours["requests"], theirs["requests"]
        assert len(mine["token_ids"]) == 5 and mine["token_ids"] == hf["token_ids"]
    out = capsys.readouterr().out
    assert "limit = those bytes / the read bandwidth measured before the round" in out
    assert "of_limit_%" in out and "median" in out


def test_single_with_int8_reads_about_a_quarter_of_the_float32_bytes(tiny_dir: Path, tmp_path: Path) -> None:
    main(
        [
            str(tiny_dir),
            "--dtype",
            "float32",
            *ARGS,
            "--single-rounds",
            "1",
            "--no-hf",
            "--quantization",
            "int8",
            "--out",
            str(tmp_path),
        ]
    )
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["quantization"] == "int8"
    fp32 = _language_model_bytes(tiny_dir, 4)
    # int8 weights (1 byte) with an fp32 scale per output row; norms and biases stay fp32
    assert 0.25 * fp32 < report["single"]["weight_bytes_per_step"] < 0.32 * fp32
    assert "transformers_step_ms" not in report["single"]["rounds"][0]


def test_vllm_prompt_text_makes_the_same_prompt_tokens_again(tiny_dir: Path) -> None:
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=256)
    for r in make_workload(llm, 3, (56, 84), 6, (2, 3), seed=5):
        text = _prompt_text(llm, r.prompt.prompt_token_ids)
        assert text.count("<|image_pad|>") == 1
        again = llm._process_prompt({"prompt": text, "multi_modal_data": {"image": r.image}}, "p", None)
        assert again.prompt_token_ids == r.prompt.prompt_token_ids


def test_single_on_an_awq_checkpoint_runs_transformers_on_the_float_one_it_came_from(
    tiny_dir: Path, tmp_path: Path
) -> None:
    from vlmserve.tools.quantize_awq import quantize_checkpoint

    awq = quantize_checkpoint(tiny_dir, tmp_path / "awq", group=32)
    argv = [str(awq), "--hf-model", str(tiny_dir), "--dtype", "float32", *ARGS, "--single-rounds", "1"]
    main([*argv, "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "bench.json").read_text())["single"]
    assert report["rounds"][0]["transformers_step_ms"] > 0  # transformers read the float checkpoint
    (theirs,) = report["transformers"][0]["requests"]
    assert len(theirs["token_ids"]) == 5
    # the decoder's linear layers at 4 bits (+ an fp32 scale and zero per 32 inputs) instead of 32
    assert report["weight_bytes_per_step"] < _language_model_bytes(tiny_dir, 4)
