"""The checkpoint as the engine core sees it: config, family (for the model class), the
processing info that memory planning needs, max_model_len and the eos ids. No tokenizer and no
processor: the engine process loads neither (the API process sends token ids, positions and
pixels, and the eos ids once at start)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vlmserve.config import ModelConfig
from vlmserve.engine.config import EngineConfig
from vlmserve.family import ModelFamily, ProcessorContext
from vlmserve.model_files import resolve_model_dir, weight_names
from vlmserve.pooling import RUNNERS, PoolerConfig, read_pooler_config
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
    # The pooling runner's pooler; None: the generation runner.
    pooler: PoolerConfig | None = None


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


def resolve_pooler(config: EngineConfig, model_dir: Path, model_config: ModelConfig) -> PoolerConfig | None:
    """The pooler the engine runs with (None: it generates). runner "auto" pools a checkpoint
    that is an embedding model by its sentence-transformers files (modules.json) or by having no
    lm_head to generate with, or that hf_overrides asks to score (classifier_from_token); vLLM's
    --runner pooling pools any."""
    if config.runner not in RUNNERS:
        raise ValueError(f"runner must be one of {list(RUNNERS)}, got {config.runner!r}")
    overrides = config.hf_overrides
    if config.runner == "generate":
        return None
    if config.runner == "auto" and not _declares_pooling(model_dir, model_config, overrides):
        return None
    config_json = json.loads((model_dir / "config.json").read_text())
    return read_pooler_config(model_dir, config_json, model_config.text.hidden_size, overrides)


def _declares_pooling(model_dir: Path, model_config: ModelConfig, overrides: dict[str, object]) -> bool:
    if (model_dir / "modules.json").is_file() or "classifier_from_token" in overrides:
        return True
    if model_config.text.tie_word_embeddings:
        return False
    names = weight_names(model_dir)  # the safetensors headers only
    return names is not None and bool(names) and "lm_head.weight" not in names


def load_engine_model(config: EngineConfig, eos_token_ids: Iterable[int], model_dir: Path | None = None) -> EngineModel:
    model_dir, model_config, family, ctx = open_checkpoint(config, model_dir)
    return EngineModel(
        model_dir,
        model_config,
        family,
        family.make_processing_info(ctx),
        ctx.limits.max_model_len,
        frozenset(eos_token_ids),
        resolve_pooler(config, model_dir, model_config),
    )
