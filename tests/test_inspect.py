"""`vlmserve inspect`: parameter counts per part from a config alone, against the reference's table for
Qwen-VL-Chat and the totals the hub lists for the Qwen2-VL / Qwen2.5-VL safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.published_configs import QWEN2_5_VL_7B, QWEN2_VL_2B, QWEN3_VL_2B, QWEN3_VL_8B, QWEN3_VL_30B_A3B
from vlmserve.entrypoints.cli import main
from vlmserve.inspect import inspect_config, load_config
from vlmserve.registry import parse_model_config

QWEN_VL_CHAT = Path(__file__).parent / "fixtures" / "qwen_vl_chat"


def test_qwen_vl_chat_counts_are_the_seeds() -> None:
    r = inspect_config(load_config(QWEN_VL_CHAT / "config.json"), torch.bfloat16)
    assert r.total == 9_656_935_168
    assert r.visual == 1_935_610_624
    assert r.adapter == 76_054_528  # the Resampler (attn_pool)
    assert r.block == [202_395_648] * 32
    assert r.embedding == r.lm_head == 622_329_856
    assert r.final_norm == 4096 and not r.tied
    # "QWen: 7721.324544 M" in the seed: everything but the vision tower.
    assert r.total - r.visual == 7_721_324_544
    assert r.weight_bytes == 2 * r.total
    assert r.kv_bytes_per_token == 32 * 2 * 32 * 128 * 2  # MHA: 32 KV heads of 128 in every layer


def test_cli_prints_the_counts(capsys: pytest.CaptureFixture[str]) -> None:
    for target in (QWEN_VL_CHAT, QWEN_VL_CHAT / "config.json"):  # a directory or the file
        assert main(["inspect", str(target)]) == 0
        out = capsys.readouterr().out
        for number in ("9,656,935,168", "1,935,610,624", "76,054,528", "202,395,648", "622,329,856"):
            assert number in out
        assert "weights in bfloat16: 19,313,870,336 bytes" in out
        assert "KV cache per token in bfloat16: 524,288 bytes" in out
    assert main(["inspect", str(QWEN_VL_CHAT), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "weights in float32: 38,627,740,672 bytes" in out and "1,048,576 bytes" in out


@pytest.mark.parametrize(
    ("raw", "total", "kv_per_token"),
    [(QWEN2_VL_2B, 2_208_985_600, 28 * 2 * 2 * 128 * 2), (QWEN2_5_VL_7B, 8_292_166_656, 28 * 2 * 4 * 128 * 2)],
)
def test_qwen2_families(raw: dict, total: int, kv_per_token: int, tmp_path: Path) -> None:
    r = inspect_config(parse_model_config(raw), torch.bfloat16)
    assert r.total == total
    assert r.kv_bytes_per_token == kv_per_token
    assert r.embedding + r.blocks + r.final_norm + r.lm_head + r.visual == r.total
    assert r.tied == raw["tie_word_embeddings"] and (r.lm_head == 0) == r.tied
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["inspect", str(tmp_path)]) == 0


def test_bad_targets_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path)]) == 2
    assert "no config.json there" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["inspect", str(tmp_path)]) == 2
    assert "unsupported model_type 'llama'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("raw", "total", "kv_per_token"),
    [
        # The hub's counts: Qwen3-VL-2B 2.13B, 8B 8.77B, 30B-A3B 31.1B parameters.
        (QWEN3_VL_2B, 2_127_532_032, 28 * 2 * 8 * 128 * 2),
        (QWEN3_VL_8B, 8_767_123_696, 36 * 2 * 8 * 128 * 2),
        (QWEN3_VL_30B_A3B, 31_070_754_032, 48 * 2 * 4 * 128 * 2),
    ],
)
def test_qwen3_vl_families(raw: dict, total: int, kv_per_token: int, tmp_path: Path) -> None:
    r = inspect_config(parse_model_config(raw), torch.bfloat16)
    assert r.total == total
    assert r.kv_bytes_per_token == kv_per_token
    assert r.embedding + r.blocks + r.final_norm + r.lm_head + r.visual == r.total
    # The vision tower holds the main merger and one DeepStack merger per feature.
    assert r.adapter * 4 < r.visual
    text = raw["text_config"]
    if "num_experts" in text:
        # 48 layers of 128 experts of 3 x 2048 x 768, 8 of them used per token.
        experts = 48 * 128 * 3 * 2048 * 768
        assert r.active == r.total - experts * 120 // 128 == 3_891_664_112
        (tmp_path / "config.json").write_text(json.dumps(raw))
        assert main(["inspect", str(tmp_path)]) == 0
    else:
        assert r.active == r.total


def test_awq_checkpoint_and_int8_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen2.5-VL-7B as AWQ publishes it: the decoder's linears 4-bit (fp16 scales and 4-bit zeros
    per 128 inputs and output channel), lm_head, embeddings and the vision tower fp16."""
    raw = {**QWEN2_5_VL_7B, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    h, i, layers = 3584, 18944, 28
    linears = [(h + 2 * 512, h), (h, h), (2 * i, h), (h, i)]  # [out, in]: qkv, o, gate+up, down
    packed = layers * sum(n * k // 2 + (k // 128) * n * 2 + (k // 128) * n // 2 for n, k in linears)
    r = inspect_config(parse_model_config(raw), torch.float16, load_packed(tmp_path))
    linear_params = layers * sum(n * k for n, k in linears)
    assert r.quantized_linears == 4 * layers
    assert r.quantized_bytes == packed + 2 * (r.total - linear_params)  # biases and the rest in fp16
    assert main(["inspect", str(tmp_path)]) == 0
    expected = packed + 2 * (r.total - linear_params)
    line = f"weights awq 4-bit, group 128 ({4 * layers} linear layers; the rest in bfloat16): {expected:,} bytes"
    assert line in capsys.readouterr().out
    # int8 on the float checkpoint: int8 matrices and fp32 scales for those and the untied lm_head
    r8 = inspect_config(parse_model_config(QWEN2_5_VL_7B), torch.bfloat16, "int8")
    vocab = QWEN2_5_VL_7B["vocab_size"]
    int8 = linear_params + layers * sum(4 * n for n, _ in linears) + vocab * h + 4 * vocab
    assert r8.quantized_bytes == int8 + 2 * (r8.total - linear_params - vocab * h)
    assert main(["inspect", str(tmp_path), "-q", "int8"]) == 2  # int8 on an AWQ checkpoint
    assert "already quantized (awq)" in capsys.readouterr().err


def load_packed(path: Path):  # type: ignore[no-untyped-def]
    from vlmserve.models.quant import read_packed_config

    return read_packed_config(path / "config.json")


def test_tensor_parallel_shares(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen2-VL-2B (12 query heads, 2 KV heads) over 2 and 4 ranks: each rank holds 1/N of the
    sharded weights plus the replicated rest (the same rest whatever N), and its KV heads: 1 of 2
    at N = 2, 1 replicated at N = 4."""
    config = parse_model_config(QWEN2_VL_2B)
    total = inspect_config(config, torch.bfloat16).weight_bytes
    two = inspect_config(config, torch.bfloat16, tensor_parallel_size=2)
    four = inspect_config(config, torch.bfloat16, tensor_parallel_size=4)
    assert len(set(two.rank_weight_bytes)) == len(set(four.rank_weight_bytes)) == 1
    replicated = 2 * two.rank_weight_bytes[0] - total
    assert 0 < replicated < 0.01 * total
    # At N = 4 every rank holds one whole KV head of k_proj / v_proj (weight and bias), half of
    # them rather than a quarter: 4 ranks together hold them twice.
    kv_projections = 28 * 2 * (2 * 128 * 1536 + 2 * 128) * 2
    assert 4 * four.rank_weight_bytes[0] - total == 3 * replicated + kv_projections
    assert two.rank_kv_bytes_per_token == (28 * 2 * 1 * 128 * 2,) * 2
    assert four.rank_kv_bytes_per_token == (28 * 2 * 1 * 128 * 2,) * 4
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_VL_2B))
    assert main(["inspect", str(tmp_path), "--tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert f"rank 1: weights {two.rank_weight_bytes[1]:,} bytes" in out
    assert main(["inspect", str(tmp_path), "--tensor-parallel-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "the vision tower's number of attention heads (16) is not divisible by tensor_parallel_size 3" in err


def test_a_hub_id_is_sized_from_its_config_json_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """inspect of org/name reads the repository's config.json (the hub cache here, offline): no
    weights fetched; with neither a cached copy nor network, one line naming what to do."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["inspect", "Qwen/Qwen2-VL-2B-Instruct"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "could not fetch its config.json" in err and "local checkpoint" in err
    # The hub cache's layout: refs/main names the snapshot holding config.json.
    repo = tmp_path / "models--Qwen--Qwen2-VL-2B-Instruct"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps(QWEN2_VL_2B))
    assert main(["inspect", "Qwen/Qwen2-VL-2B-Instruct"]) == 0
    assert "2,208,985,600" in capsys.readouterr().out
