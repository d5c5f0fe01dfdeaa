"""The one list of model families vlmserve runs, by architecture, and the lookups the rest of the
code makes through it. Adding a family: its folder under vlmserve/families/ and one line below."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmserve.config import ModelConfig, read_config_json
from vlmserve.families.qwen2_vl.family import QWEN2_5_VL, QWEN2_VL
from vlmserve.families.qwen3_5.family import QWEN3_5, QWEN3_5_MOE
from vlmserve.families.qwen3_vl.family import QWEN3_VL, QWEN3_VL_MOE
from vlmserve.families.qwen_vl.family import QWEN_VL
from vlmserve.family import ModelFamily
from vlmserve.family_names import NAMES
from vlmserve.grounding import GroundingConvention

FAMILIES: tuple[ModelFamily, ...] = (QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE, QWEN3_5, QWEN3_5_MOE, QWEN_VL)

BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
# model_type -> the family a config.json without `architectures` means.
BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}
BY_NAME = {f.name: f for f in FAMILIES}
if {f.name: f.display_name for f in FAMILIES} != NAMES:
    raise RuntimeError(f"vlmserve.family_names.NAMES is not the registry's families: {list(BY_NAME)}")
# Every family's way of writing boxes, by name (families may share one).
GROUNDING_CONVENTIONS = {f.grounding.name: f.grounding for f in FAMILIES}


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """config.json's contents (any published layout of a family vlmserve runs) -> ModelConfig."""
    model_type = raw.get("model_type")
    if model_type not in BY_MODEL_TYPE:
        raise ValueError(
            f"unsupported model_type {model_type!r}; vlmserve runs {' and '.join(BY_MODEL_TYPE)} checkpoints"
        )
    return BY_MODEL_TYPE[model_type].parse_config(raw)


def load_model_config(path: Path) -> ModelConfig:
    return parse_model_config(read_config_json(path))


def family_of(config: ModelConfig) -> ModelFamily:
    family = BY_ARCHITECTURE.get(config.architecture)
    if family is None:
        raise ValueError(f"unsupported architecture {config.architecture!r}; supported: {sorted(BY_ARCHITECTURE)}")
    return family


def grounding_convention(name: str) -> GroundingConvention:
    """The box convention (vlmserve.grounding) a server's response or `--box-convention` names."""
    convention = GROUNDING_CONVENTIONS.get(name)
    if convention is None:
        raise ValueError(f"unknown box convention {name!r}; expected one of {list(GROUNDING_CONVENTIONS)}")
    return convention


def convention_for_model(model_type: str) -> GroundingConvention:
    """The box convention (vlmserve.grounding) of a checkpoint's model_type (config.json)."""
    family = BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise ValueError(
            f"no known box convention for model_type {model_type!r}; "
            f"name one of {list(GROUNDING_CONVENTIONS)} explicitly"
        )
    return family.grounding
