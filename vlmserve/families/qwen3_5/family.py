"""Qwen3.5 and Qwen3.5-MoE as the rest of vlmserve sees them (vlmserve/family.py). Its processor, chat rendering
and box convention are Qwen3-VL's."""

from __future__ import annotations

import dataclasses

from vlmserve.families.common.entry import preset_writer
from vlmserve.families.qwen3_5.config import (
    QWEN3_5_ARCHITECTURE,
    QWEN3_5_MOE_ARCHITECTURE,
    parse_qwen3_5_config,
    parse_qwen3_5_moe_config,
)
from vlmserve.families.qwen3_5.model import Qwen35ForConditionalGeneration, Qwen35MoeForConditionalGeneration
from vlmserve.families.qwen3_5.tiny import PRESETS, write_tiny_qwen3_5
from vlmserve.families.qwen3_vl.family import QWEN3_VL

QWEN3_5 = dataclasses.replace(
    QWEN3_VL,
    architecture=QWEN3_5_ARCHITECTURE,
    model_type="qwen3_5",
    name="qwen3_5",
    display_name="Qwen3.5",
    parse_config=parse_qwen3_5_config,
    model_class=Qwen35ForConditionalGeneration,
    write_tiny=preset_writer("qwen3_5", PRESETS, write_tiny_qwen3_5, "nested"),
    transformers_class="Qwen3_5ForConditionalGeneration",
)

QWEN3_5_MOE = dataclasses.replace(
    QWEN3_5,
    architecture=QWEN3_5_MOE_ARCHITECTURE,
    model_type="qwen3_5_moe",
    name="qwen3_5_moe",
    display_name="Qwen3.5-MoE",
    parse_config=parse_qwen3_5_moe_config,
    model_class=Qwen35MoeForConditionalGeneration,
    write_tiny=preset_writer("qwen3_5_moe", PRESETS, write_tiny_qwen3_5, "nested"),
    transformers_class="Qwen3_5MoeForConditionalGeneration",
)
