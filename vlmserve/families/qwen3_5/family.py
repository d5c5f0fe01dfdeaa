"""Qwen3.5 and Qwen3.5-MoE as the rest of vlmserve sees them (vlmserve/family.py). Its processor, chat rendering
and box convention are Qwen3-VL's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from vlmserve.families.qwen3_5.config import (
    QWEN3_5_ARCHITECTURE,
    QWEN3_5_MOE_ARCHITECTURE,
    parse_qwen3_5_config,
    parse_qwen3_5_moe_config,
)
from vlmserve.families.qwen3_5.model import Qwen35ForConditionalGeneration, Qwen35MoeForConditionalGeneration
from vlmserve.families.qwen3_5.tiny import PRESETS, write_tiny_qwen3_5
from vlmserve.families.qwen3_vl.family import QWEN3_VL


def _writer(arch: str) -> Any:
    def write_tiny(
        out_dir: str | Path,
        *,
        seed: int = 0,
        num_shards: int = 1,
        preset: str = "tiny",
        nested_config: bool = False,
        untied: bool = False,
    ) -> Path:
        del nested_config  # Qwen3.5 is published in the nested layout only
        if (arch, preset) not in PRESETS:
            raise ValueError(f"no preset {preset!r}; choose one of {sorted(p for a, p in PRESETS if a == arch)}")
        spec = PRESETS[(arch, preset)]
        if untied:
            spec = dataclasses.replace(spec, tie_word_embeddings=False)
        return write_tiny_qwen3_5(out_dir, spec, seed=seed, num_shards=num_shards)

    return write_tiny


QWEN3_5 = dataclasses.replace(
    QWEN3_VL,
    architecture=QWEN3_5_ARCHITECTURE,
    model_type="qwen3_5",
    name="qwen3_5",
    display_name="Qwen3.5",
    parse_config=parse_qwen3_5_config,
    model_class=Qwen35ForConditionalGeneration,
    write_tiny=_writer("qwen3_5"),
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
    write_tiny=_writer("qwen3_5_moe"),
    transformers_class="Qwen3_5MoeForConditionalGeneration",
)
