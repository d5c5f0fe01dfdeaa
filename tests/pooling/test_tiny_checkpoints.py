"""make-tiny's embedding and reranker presets write Qwen3-VL-Embedding's and Qwen3-VL-Reranker's
published layouts: the embedding's config.json (untied, use_cache false) without any lm_head
weight and with sentence-transformers' files declaring last-token pooling and normalisation; the
reranker's full untied lm_head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.entrypoints.test_cli import vlmserve
from vlmserve.model_files import VOCAB_SIZE, weight_names


def _json(path: Path) -> dict:  # type: ignore[type-arg]
    return json.loads(path.read_text())


def test_the_embedding_preset_has_no_lm_head_and_declares_last_token_pooling(embedding_dir: Path) -> None:
    config = _json(embedding_dir / "config.json")
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"] and config["model_type"] == "qwen3_vl"
    assert config["tie_word_embeddings"] is False and config["use_cache"] is False
    names = set(weight_names(embedding_dir) or [])
    assert "model.language_model.embed_tokens.weight" in names and not any("lm_head" in n for n in names)
    hidden = config["text_config"]["hidden_size"]

    modules = _json(embedding_dir / "modules.json")
    assert [(m["path"], m["type"].rsplit(".", 1)[-1]) for m in modules] == [
        ("", "Transformer"),
        ("1_Pooling", "Pooling"),
        ("2_Normalize", "Normalize"),
    ]
    pooling = _json(embedding_dir / "1_Pooling" / "config.json")
    assert pooling["pooling_mode"] == "lasttoken" and pooling["embedding_dimension"] == hidden
    assert (embedding_dir / "2_Normalize" / "config.json").is_file()
    transformer = _json(embedding_dir / "sentence_bert_config.json")
    assert transformer["transformer_task"] == "feature-extraction"
    assert transformer["processing_kwargs"]["chat_template"]["add_generation_prompt"] is True
    assert _json(embedding_dir / "config_sentence_transformers.json")["similarity_fn_name"] == "cosine"


def test_the_reranker_preset_keeps_the_whole_untied_lm_head(reranker_dir: Path) -> None:
    config = _json(reranker_dir / "config.json")
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"] and config["tie_word_embeddings"] is False
    assert "use_cache" not in config
    with safe_open(str(reranker_dir / "model.safetensors"), "pt") as f:
        head, embedding = f.get_tensor("lm_head.weight"), f.get_tensor("model.language_model.embed_tokens.weight")
    assert head.shape == (VOCAB_SIZE, config["text_config"]["hidden_size"]) and not head.equal(embedding)
    assert not (reranker_dir / "modules.json").exists()


def test_the_generation_preset_is_unchanged(tmp_path: Path) -> None:
    """The presets add files and drop weights only where asked: the plain tiny Qwen3-VL has none of them."""
    from vlmserve.registry import BY_NAME

    out = BY_NAME["qwen3_vl"].write_tiny(tmp_path / "t")
    assert "use_cache" not in _json(out / "config.json")
    assert not (out / "modules.json").exists() and not (out / "1_Pooling").exists()


def test_other_families_refuse_the_presets(tmp_path: Path) -> None:
    from vlmserve.registry import BY_NAME

    with pytest.raises(ValueError, match="no preset 'embedding'"):
        BY_NAME["qwen2_vl"].write_tiny(tmp_path / "t", preset="embedding")


def test_make_tiny_writes_the_reranker_preset(tmp_path: Path) -> None:
    result = vlmserve("make-tiny", str(tmp_path / "r"), "--arch", "qwen3_vl", "--preset", "reranker")
    assert result.returncode == 0, result.stderr
    assert "lm_head.weight" in set(weight_names(tmp_path / "r") or [])


# Qwen3-VL-2B-Instruct's published sizes (its config.json), which Qwen3-VL-Embedding-2B keeps.
QWEN3_VL_2B_TEXT = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
}
QWEN3_VL_2B_VISION = {
    "depth": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "out_hidden_size": 2048,
    "deepstack_visual_indexes": [5, 11, 17],
}


@pytest.mark.parametrize("preset", ["embedding-2b", "embedding-bench"])
def test_the_embedding_2b_presets_are_qwen3_vl_embedding_2b_in_the_embedding_layout(preset: str) -> None:
    """embedding-2b: the whole architecture; embedding-bench: its widths, 4 decoder layers and a
    narrow tower. Both in the embedding layout (use_cache false, no lm_head weight: the 2B ties it,
    sentence-transformers' files for 2048-wide embeddings). The weights are not written here
    (4.3 GB): the layout is the embedding preset's, checked above."""
    from vlmserve.families.qwen3_vl.tiny import PRESETS, config_json
    from vlmserve.families.qwen3_vl.tiny_retrieval import sentence_transformers_files

    spec = PRESETS[("qwen3_vl", preset)]
    config = config_json(spec)
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"] and config["use_cache"] is False
    assert config["tie_word_embeddings"] is True
    text, vision = config["text_config"], config["vision_config"]
    assert isinstance(text, dict) and isinstance(vision, dict)
    if preset == "embedding-2b":
        assert {k: text[k] for k in QWEN3_VL_2B_TEXT} == QWEN3_VL_2B_TEXT
        assert {k: vision[k] for k in QWEN3_VL_2B_VISION} == QWEN3_VL_2B_VISION
    else:
        assert {k: text[k] for k in QWEN3_VL_2B_TEXT} == QWEN3_VL_2B_TEXT | {"num_hidden_layers": 4}
        assert vision["depth"] == 4 and vision["out_hidden_size"] == 2048
    pooling = sentence_transformers_files(spec.hidden_size)["1_Pooling/config.json"]
    assert isinstance(pooling, dict) and pooling["embedding_dimension"] == 2048


def test_make_tiny_offers_the_embedding_2b_presets() -> None:
    import argparse

    from vlmserve.entrypoints.cli import _make_tiny_arguments

    parser = argparse.ArgumentParser()
    _make_tiny_arguments(parser)
    for preset in ("embedding-2b", "embedding-bench"):
        assert parser.parse_args(["out", "--arch", "qwen3_vl", "--preset", preset]).preset == preset
