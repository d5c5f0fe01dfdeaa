"""The checkpoint as the engine core sees it: config, family (for the model class), the
processing info that memory planning needs, max_model_len and the eos ids. No tokenizer and no
processor: the engine process loads neither (the API process sends token ids, positions and
pixels, and the eos ids once at start)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vlmserve.config import ModelConfig
from vlmserve.engine.config import EngineConfig
from vlmserve.family import ModelFamily, ProcessorContext
from vlmserve.model_files import resolve_model_dir
from vlmserve.processor.base import ProcessingInfo, ProcessorLimits
from vlmserve.registry import family_of, load_model_config


@dataclass(frozen=True)
class EngineModel:
    model_dir: Path
    model_config: ModelConfig
    family: ModelFamily
    processing: ProcessingInfo
    max_model_len: int
    eos_token_ids: frozenset[int]


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.text.max_position_embeddings
    max_model_len = config.max_model_len or limit
    if not 1 < max_model_len <= limit:
        raise ValueError(f"max_model_len must be in 2..{limit} (max_position_embeddings), got {max_model_len}")
    return max_model_len


def open_checkpoint(
    config: EngineConfig, model_dir: Path | None = None
) -> tuple[Path, ModelConfig, ModelFamily, ProcessorContext]:
    """The checkpoint's directory, its parsed config.json, its family, and what its processor is
    built from: what both the engine and the front end start from."""
    model_dir = model_dir or resolve_model_dir(config.model, config.revision)
    model_config = load_model_config(model_dir / "config.json")
    ctx = ProcessorContext(
        model_dir,
        model_config,
        ProcessorLimits(resolve_max_model_len(config, model_config), dict(config.limit_mm_per_prompt)),
        config.media_limits,
        dict(config.mm_processor_kwargs),
    )
    return model_dir, model_config, family_of(model_config), ctx


def load_engine_model(config: EngineConfig, eos_token_ids: Iterable[int], model_dir: Path | None = None) -> EngineModel:
    model_dir, model_config, family, ctx = open_checkpoint(config, model_dir)
    return EngineModel(
        model_dir,
        model_config,
        family,
        family.make_processing_info(ctx),
        ctx.limits.max_model_len,
        frozenset(eos_token_ids),
    )
