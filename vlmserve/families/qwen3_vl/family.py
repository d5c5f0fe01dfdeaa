"""Qwen3-VL and Qwen3-VL-MoE as the rest of vlmserve sees them (vlmserve/family.py)."""

from __future__ import annotations

import dataclasses

from vlmserve.families.common.entry import (
    BOX_TOKENS,
    INSPECT_PARTS,
    MERGER_NAME,
    image_processor_config,
    no_extra_eos,
    preset_writer,
)
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
from vlmserve.grounding import GroundingConvention
from vlmserve.model_files import read_json
from vlmserve.multimodal.image import ImageProcessorConfig
from vlmserve.tokenizer import Tokenizer


def _video_config(ctx: ProcessorContext) -> ImageProcessorConfig:
    """video_preprocessor_config.json (its size bounds a whole video's pixels); the image
    processor's config where a checkpoint has none."""
    path = ctx.model_dir / "video_preprocessor_config.json"
    raw = read_json(path) if path.is_file() else read_json(ctx.model_dir / "preprocessor_config.json")
    return ImageProcessorConfig.from_dict(raw)


def make_processing_info(ctx: ProcessorContext) -> Qwen3VLProcessingInfo:
    return Qwen3VLProcessingInfo(ctx.model_config, image_processor_config(ctx), ctx.limits, ctx.media_limits)


def make_processor(ctx: ProcessorContext, tokenizer: Tokenizer) -> Qwen3VLProcessor:
    return Qwen3VLProcessor(
        ctx.model_config, tokenizer, image_processor_config(ctx), ctx.limits, ctx.media_limits, _video_config(ctx)
    )


QWEN3_VL = ModelFamily(
    architecture=QWEN3_VL_ARCHITECTURE,
    model_type="qwen3_vl",
    name="qwen3_vl",
    display_name="Qwen3-VL",
    parse_config=parse_qwen3_vl_config,
    model_class=Qwen3VLForConditionalGeneration,
    load_tokenizer=Tokenizer,
    make_processing_info=make_processing_info,
    make_processor=make_processor,
    render_chat=render_chat,
    extra_eos_token_ids=no_extra_eos,
    # Qwen2.5-VL's JSON with its numbers back on the 0..1000 scale of the image.
    grounding=GroundingConvention("qwen3-vl", "normalized", BOX_TOKENS),
    write_tiny=preset_writer("qwen3_vl", PRESETS, write_tiny_qwen3_vl, "nested"),
    inspect_parts=INSPECT_PARTS,
    adapter_name=MERGER_NAME,
    transformers_class="Qwen3VLForConditionalGeneration",
)

QWEN3_VL_MOE = dataclasses.replace(
    QWEN3_VL,
    architecture=QWEN3_VL_MOE_ARCHITECTURE,
    model_type="qwen3_vl_moe",
    name="qwen3_vl_moe",
    display_name="Qwen3-VL-MoE",
    parse_config=parse_qwen3_vl_moe_config,
    model_class=Qwen3VLMoeForConditionalGeneration,
    write_tiny=preset_writer("qwen3_vl_moe", PRESETS, write_tiny_qwen3_vl, "nested"),
    transformers_class="Qwen3VLMoeForConditionalGeneration",
)
