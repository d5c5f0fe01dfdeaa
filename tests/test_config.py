from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.published_configs import QWEN2_5_VL_7B, QWEN2_VL_2B, QWEN3_VL_8B, QWEN3_VL_30B_A3B
from vlmserve.config import ModelConfig, parse_dtype
from vlmserve.families.qwen3_5.tiny import MOE_SPEC as QWEN3_5_MOE_SPEC
from vlmserve.families.qwen3_5.tiny import TinySpec as Qwen35Spec
from vlmserve.families.qwen3_5.tiny import config_json as qwen3_5_config_json
from vlmserve.registry import BY_MODEL_TYPE, load_model_config, parse_model_config


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


# -- a field under each name transformers' config classes accept --------------------------------

# A config.json of each family transformers has: as published where one is at hand, else the tiny one.
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_vl": QWEN2_VL_2B,
    "qwen2_5_vl": QWEN2_5_VL_7B,
    "qwen3_vl": QWEN3_VL_8B,
    "qwen3_vl_moe": QWEN3_VL_30B_A3B,
    "qwen3_5": qwen3_5_config_json(Qwen35Spec()),
    "qwen3_5_moe": qwen3_5_config_json(QWEN3_5_MOE_SPEC),
}
# Each field an attribute_map names, by the name transformers stores it under: a value other than
# the config's own (and than the parser's default), and where vlmserve's ModelConfig holds it.
FIELDS: dict[str, tuple[Callable[[int], int], Callable[[ModelConfig], int]]] = {
    "num_heads": (lambda v: v // 2, lambda c: c.vision.num_heads),
    "depth": (lambda v: v + 1, lambda c: c.vision.depth),
    "num_local_experts": (lambda v: 2 * v, lambda c: c.family_config.moe.num_experts),
}


def test_every_family_transformers_has_is_checked_below() -> None:
    from transformers import CONFIG_MAPPING

    assert {model_type for model_type in BY_MODEL_TYPE if model_type in CONFIG_MAPPING} == set(CONFIGS)


@pytest.mark.parity
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_every_name_transformers_accepts_for_a_field_reads_as_transformers_reads_it(model_type: str) -> None:
    """For each attribute_map entry of the family's config classes (top level, text_config,
    vision_config), config.json with the field under either name only: vlmserve reads the value
    transformers reads."""
    import transformers
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    checked = []
    for section, section_class in [(None, config_class), *config_class.sub_configs.items()]:
        for alias, stored in section_class.attribute_map.items():
            assert stored in FIELDS, (
                f"transformers {transformers.__version__}'s {section_class.__name__} reads {alias!r} as {stored!r}: "
                f"add it to the family's FieldAliases and to FIELDS here"
            )
            new_value, ours_of = FIELDS[stored]
            raw = copy.deepcopy(CONFIGS[model_type])
            fields = raw if section is None or section not in raw else raw[section]
            value = new_value(fields.pop(alias) if alias in fields else fields.pop(stored))
            for name in (alias, stored):
                fields[name] = value
                theirs = config_class.from_dict(raw)
                theirs_value = getattr(theirs if section is None else getattr(theirs, section), stored)
                assert ours_of(parse_model_config(raw)) == theirs_value == value, (section, name)
                del fields[name]
            checked.append(alias)
    # Not vacuous: the names transformers 5.23 and 5.24 map were all tried.
    assert {"num_attention_heads", "num_hidden_layers"} <= set(checked)
    assert ("num_experts" in checked) == (model_type == "qwen3_vl_moe")


def test_a_field_under_both_names_with_two_values_is_refused() -> None:
    text = QWEN3_VL_30B_A3B["text_config"]
    with pytest.raises(ValueError) as error:
        parse_model_config({**QWEN3_VL_30B_A3B, "text_config": {**text, "num_local_experts": 64}})
    assert str(error.value) == (
        "config.json: text_config gives one field twice with different values: 'num_experts' is 128 and "
        "'num_local_experts' (another name for it) is 64; keep one of them"
    )
    same = parse_model_config({**QWEN3_VL_30B_A3B, "text_config": {**text, "num_local_experts": 128}})
    assert same.family_config.moe.num_experts == 128
    vision = {**QWEN2_VL_2B["vision_config"], "num_attention_heads": 8}  # num_heads is 16
    with pytest.raises(
        ValueError, match="vision_config gives one field twice .* 'num_heads' is 16 and 'num_attention_heads'"
    ):
        parse_model_config({**QWEN2_VL_2B, "vision_config": vision})
    without = {k: v for k, v in text.items() if k != "num_experts"}
    with pytest.raises(ValueError) as error:
        parse_model_config({**QWEN3_VL_30B_A3B, "text_config": without})
    assert (
        str(error.value) == "config.json: the text config lacks required field 'num_experts' (or 'num_local_experts')"
    )
