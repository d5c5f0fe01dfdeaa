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
