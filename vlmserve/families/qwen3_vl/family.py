"""Qwen3-VL and Qwen3-VL-MoE as the rest of vlmserve sees them (vlmserve/family.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from vlmserve.families.qwen2_vl.family import render_chat
from vlmserve.families.qwen3_vl.config import (
    QWEN3_VL_ARCHITECTURE,
    QWEN3_VL_MOE_ARCHITECTURE,
    parse_qwen3_vl_config,
    parse_qwen3_vl_moe_config,
)
from vlmserve.families.qwen3_vl.model import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration
from vlmserve.families.qwen3_vl.processor import Qwen3VLProcessingInfo, Qwen3VLProcessor
from vlmserve.families.qwen3_vl.tiny import PRESETS, write_tiny_qwen3_vl
from vlmserve.family import ModelFamily, ProcessorContext
from vlmserve.model_files import read_json
from vlmserve.multimodal.image import ImageProcessorConfig
from vlmserve.tokenizer import Tokenizer

# The engine-wide options (LLM(mm_processor_kwargs=...)) this processor takes.
PROCESSOR_OPTIONS = ("min_pixels", "max_pixels")


def _image_config(ctx: ProcessorContext) -> ImageProcessorConfig:
    unknown = set(ctx.mm_processor_kwargs) - set(PROCESSOR_OPTIONS)
    if unknown:
        raise ValueError(
            f"mm_processor_kwargs: unknown keys {sorted(unknown)}; supported: {', '.join(PROCESSOR_OPTIONS)}"
        )
    preprocessor = read_json(ctx.model_dir / "preprocessor_config.json") | dict(ctx.mm_processor_kwargs)
    return ImageProcessorConfig.from_dict(preprocessor)


def _video_config(ctx: ProcessorContext) -> ImageProcessorConfig:
    """video_preprocessor_config.json (its size bounds a whole video's pixels); the image
    processor's config where a checkpoint has none."""
    path = ctx.model_dir / "video_preprocessor_config.json"
    raw = read_json(path) if path.is_file() else read_json(ctx.model_dir / "preprocessor_config.json")
    return ImageProcessorConfig.from_dict(raw)


def make_processing_info(ctx: ProcessorContext) -> Qwen3VLProcessingInfo:
    return Qwen3VLProcessingInfo(ctx.model_config, _image_config(ctx), ctx.limits, ctx.media_limits)


def make_processor(ctx: ProcessorContext, tokenizer: Tokenizer) -> Qwen3VLProcessor:
    return Qwen3VLProcessor(
        ctx.model_config, tokenizer, _image_config(ctx), ctx.limits, ctx.media_limits, _video_config(ctx)
    )


def preset_writer(arch: str, presets: dict[tuple[str, str], Any], write: Any) -> Any:
    """ModelFamily.write_tiny for a family published in the nested layout only: `preset` picks
    `presets[(arch, preset)]`, `untied` unties its embedding, then `write(out_dir, spec, seed=,
    num_shards=)` writes it."""

    def write_tiny(
        out_dir: str | Path,
        *,
        seed: int = 0,
        num_shards: int = 1,
        preset: str = "tiny",
        nested_config: bool = False,
        untied: bool = False,
    ) -> Path:
        del nested_config  # the nested layout is the only one published
        if (arch, preset) not in presets:
            raise ValueError(f"no preset {preset!r}; choose one of {sorted(p for a, p in presets if a == arch)}")
        spec = presets[(arch, preset)]
        if untied:
            spec = dataclasses.replace(spec, tie_word_embeddings=False)
        return write(out_dir, spec, seed=seed, num_shards=num_shards)

    return write_tiny


_COMMON: dict[str, Any] = dict(
    load_tokenizer=Tokenizer,
    make_processing_info=make_processing_info,
    make_processor=make_processor,
    render_chat=render_chat,
    extra_eos_token_ids=lambda tokenizer: [],
    grounding_convention="qwen3-vl",
    inspect_parts={
        "embedding": "model.embed_tokens",
        "blocks": "model.layers",
        "final_norm": "model.norm",
        "visual": "visual",
        "adapter": "visual.merger",
    },
    adapter_name="patch merger (merger)",
)

QWEN3_VL = ModelFamily(
    architecture=QWEN3_VL_ARCHITECTURE,
    model_type="qwen3_vl",
    name="qwen3_vl",
    display_name="Qwen3-VL",
    parse_config=parse_qwen3_vl_config,
    model_class=Qwen3VLForConditionalGeneration,
    write_tiny=preset_writer("qwen3_vl", PRESETS, write_tiny_qwen3_vl),
    transformers_class="Qwen3VLForConditionalGeneration",
    **_COMMON,
)

QWEN3_VL_MOE = ModelFamily(
    architecture=QWEN3_VL_MOE_ARCHITECTURE,
    model_type="qwen3_vl_moe",
    name="qwen3_vl_moe",
    display_name="Qwen3-VL-MoE",
    parse_config=parse_qwen3_vl_moe_config,
    model_class=Qwen3VLMoeForConditionalGeneration,
    write_tiny=preset_writer("qwen3_vl_moe", PRESETS, write_tiny_qwen3_vl),
    transformers_class="Qwen3VLMoeForConditionalGeneration",
    **_COMMON,
)
