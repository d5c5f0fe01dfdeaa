from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.published_configs import QWEN2_VL_2B
from vlmserve.config import parse_dtype
from vlmserve.registry import load_model_config, parse_model_config


@pytest.mark.parity
def test_flat_and_nested_layouts_parse_alike(tiny_dir: Path, tmp_path: Path) -> None:
    flat = load_model_config(tiny_dir / "config.json")
    # The same model saved by transformers 5 (nested text_config, rope_parameters).
    from transformers import Qwen2VLConfig

    Qwen2VLConfig.from_pretrained(str(tiny_dir)).save_pretrained(str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "text_config" in raw and "rope_scaling" not in raw
    nested = load_model_config(tmp_path / "config.json")
    assert nested.text == flat.text
    assert nested.vision == flat.vision
    assert flat.text.mrope_section == (2, 3, 3)
    assert flat.text.tie_word_embeddings is True
    assert flat.checkpoint_dtype == torch.bfloat16 == nested.checkpoint_dtype
    assert (flat.image_token_id, flat.video_token_id, flat.vision_start_token_id) == (151655, 151656, 151652)


def test_published_2b_values() -> None:
    raw = dict(QWEN2_VL_2B)  # Qwen2-VL-2B-Instruct's config.json as published
    config = parse_model_config(raw)
    assert config.text.head_dim == 128
    assert config.vision.head_dim == 80
    assert config.vision.patch_dim == 1176
    assert config.vision.hidden_act == "quick_gelu"


def test_bad_configs_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        parse_model_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="lacks required field 'hidden_size'"):
        parse_model_config({"model_type": "qwen2_vl"})
    bad_section = {
        "model_type": "qwen2_vl",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 10,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 2]},
    }
    with pytest.raises(ValueError, match="mrope_section"):
        parse_model_config(bad_section)


def test_parse_dtype() -> None:
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("torch.float16") is torch.float16
    assert parse_dtype("auto", torch.float32) is torch.float32
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        parse_dtype("int8")
