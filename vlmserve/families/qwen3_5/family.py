"""Qwen3.5 as the rest of vlmserve sees it (vlmserve/family.py). Its processor, chat rendering
and box convention are Qwen3-VL's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from vlmserve.families.qwen3_5.config import QWEN3_5_ARCHITECTURE, parse_qwen3_5_config
from vlmserve.families.qwen3_5.model import Qwen35ForConditionalGeneration
from vlmserve.families.qwen3_5.tiny import PRESETS, write_tiny_qwen3_5
from vlmserve.families.qwen3_vl.family import QWEN3_VL


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
    if preset not in PRESETS:
        raise ValueError(f"no preset {preset!r}; choose one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    if untied:
        spec = dataclasses.replace(spec, tie_word_embeddings=False)
    return write_tiny_qwen3_5(out_dir, spec, seed=seed, num_shards=num_shards)


QWEN3_5 = dataclasses.replace(
    QWEN3_VL,
    architecture=QWEN3_5_ARCHITECTURE,
    model_type="qwen3_5",
    name="qwen3_5",
    display_name="Qwen3.5",
    parse_config=parse_qwen3_5_config,
    model_class=Qwen35ForConditionalGeneration,
    write_tiny=write_tiny,
    transformers_class="Qwen3_5ForConditionalGeneration",
)
