"""Qwen-VL-Chat as the rest of vlmserve sees them (vlmserve/family.py)."""

from __future__ import annotations

from typing import Any

from vlmserve.families.common.entry import preset_writer
from vlmserve.families.qwen_vl.chat_format import chat_prompt, stop_token_ids
from vlmserve.families.qwen_vl.config import QWEN_VL_ARCHITECTURE, parse_qwen_vl_config, qwen_vl_config
from vlmserve.families.qwen_vl.model import QWenLMHeadModel
from vlmserve.families.qwen_vl.processor import QwenVLProcessingInfo, QwenVLProcessor
from vlmserve.families.qwen_vl.tiny import PRESETS, write_tiny_qwen_vl
from vlmserve.families.qwen_vl.tokenizer import QwenVLTokenizer
from vlmserve.family import ModelFamily, ProcessorContext
from vlmserve.grounding import BoxTags, GroundingConvention
from vlmserve.processor.base import RenderedChat


def make_processing_info(ctx: ProcessorContext) -> QwenVLProcessingInfo:
    # Every image is 448 x 448 (no resize options).
    if ctx.mm_processor_kwargs:
        raise ValueError("mm_processor_kwargs: Qwen-VL-Chat takes every image at 448 x 448; no options")
    qwen = qwen_vl_config(ctx.model_config)
    return QwenVLProcessingInfo(
        ctx.limits,
        ctx.media_limits,
        vocab_size=ctx.model_config.text.vocab_size,
        image_start_id=qwen.visual.image_start_id,
        ntk_seq_length=qwen.seq_length if qwen.use_dynamic_ntk else None,
    )


def make_processor(ctx: ProcessorContext, tokenizer: QwenVLTokenizer) -> QwenVLProcessor:
    info = make_processing_info(ctx)
    if tokenizer.img_start_id != info.image_start_id:
        raise ValueError(
            f"config.json's visual.image_start_id {info.image_start_id} is not the tokenizer's <img> "
            f"({tokenizer.img_start_id})"
        )
    return QwenVLProcessor(tokenizer, ctx.limits, ctx.media_limits, info.vocab_size, info.ntk_seq_length)


def render_chat(
    tokenizer: QwenVLTokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    chat_template: str | None,
    chat_template_kwargs: dict[str, Any],
) -> RenderedChat:
    """make_context's chatml with history, as token ids (its turns are encoded one by one)."""
    if chat_template is not None:
        raise ValueError("Qwen-VL-Chat has no chat template to replace; it prompts as make_context does")
    if chat_template_kwargs.get("tools"):
        raise ValueError("tools: Qwen-VL-Chat's chat format does not take tools")
    # What the server passes every template (tools, none here; reasoning_effort): no format option.
    chat_template_kwargs = {k: v for k, v in chat_template_kwargs.items() if k not in ("tools", "reasoning_effort")}
    unknown = set(chat_template_kwargs) - {"system", "max_window_size"}
    if unknown:
        raise ValueError(f"chat_template_kwargs: unknown keys {sorted(unknown)}; supported: system, max_window_size")
    system = chat_template_kwargs.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"chat_template_kwargs.system must be a string, got {type(system).__name__}")
    window = chat_template_kwargs.get("max_window_size")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"chat_template_kwargs.max_window_size must be a positive integer (tokens), got {window!r}")
    chat = chat_prompt(tokenizer, messages, add_generation_prompt, **chat_template_kwargs)
    return RenderedChat(chat.token_ids, chat.images)


QWEN_VL = ModelFamily(
    architecture=QWEN_VL_ARCHITECTURE,
    model_type="qwen",
    name="qwen_vl",
    display_name="Qwen-VL-Chat",
    parse_config=parse_qwen_vl_config,
    model_class=QWenLMHeadModel,
    load_tokenizer=QwenVLTokenizer,
    make_processing_info=make_processing_info,
    make_processor=make_processor,
    render_chat=render_chat,
    # Its chat() stops on <|im_end|> or <|im_start|> (stop words) as well as <|endoftext|>.
    extra_eos_token_ids=stop_token_ids,
    # `<ref>dog</ref><box>(x1,y1),(x2,y2)</box>` on the 0..1000 scale of the image.
    grounding=GroundingConvention(
        "qwen-vl", "normalized", BoxTags(ref=("<ref>", "</ref>"), box=("<box>", "</box>"), quad=("<quad>", "</quad>"))
    ),
    write_tiny=preset_writer("qwen_vl", PRESETS, write_tiny_qwen_vl, "flat"),
    inspect_parts={
        "embedding": "transformer.wte",
        "blocks": "transformer.h",
        "final_norm": "transformer.ln_f",
        "visual": "transformer.visual",
        "adapter": "transformer.visual.attn_pool",
    },
    adapter_name="resampler (attn_pool)",
    transformers_class=None,  # remote code only
)
