"""Qwen2-VL and Qwen2.5-VL as the rest of vlmserve sees them (vlmserve/family.py)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from vlmserve.families.common.entry import (
    BOX_TOKENS,
    INSPECT_PARTS,
    MERGER_NAME,
    image_processor_config,
    no_extra_eos,
    preset_writer,
)
from vlmserve.families.qwen2_vl.config import (
    QWEN2_5_VL_ARCHITECTURE,
    QWEN2_VL_ARCHITECTURE,
    parse_qwen2_5_vl_config,
    parse_qwen2_vl_config,
)
from vlmserve.families.qwen2_vl.model import Qwen2VLForConditionalGeneration
from vlmserve.families.qwen2_vl.model_2_5 import Qwen2_5_VLForConditionalGeneration
from vlmserve.families.qwen2_vl.processor import Qwen2VLProcessingInfo, Qwen2VLProcessor
from vlmserve.families.qwen2_vl.tiny import PRESETS, write_tiny_qwen2_vl
from vlmserve.family import ModelFamily, ProcessorContext
from vlmserve.grounding import GroundingConvention
from vlmserve.processor.base import RenderedChat
from vlmserve.processor.chat import parse_chat_messages
from vlmserve.tokenizer import Tokenizer, template_variables

# What Tokenizer.apply_chat_template passes the template itself: not a chat_template_kwargs key.
RESERVED_TEMPLATE_ARGUMENTS = frozenset(
    {"messages", "add_generation_prompt", "chat_template", "bos_token", "eos_token", "pad_token", "unk_token"}
)


def make_processing_info(ctx: ProcessorContext) -> Qwen2VLProcessingInfo:
    return Qwen2VLProcessingInfo(ctx.model_config, image_processor_config(ctx), ctx.limits, ctx.media_limits)


def make_processor(ctx: ProcessorContext, tokenizer: Tokenizer) -> Qwen2VLProcessor:
    return Qwen2VLProcessor(ctx.model_config, tokenizer, image_processor_config(ctx), ctx.limits, ctx.media_limits)


# How a template that takes each message's content as one string sees an image or a video.
_PLACEHOLDERS = {
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
}
_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+(\[\s*['\"]content['\"]\s*\]|\.content)")


def _loops_over_content(template: str) -> bool:
    """Whether the template reads content as a list of parts (else: content is a string)."""
    return _CONTENT_LOOP.search(template) is not None


def _flattened(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content is a list of parts as one string, as vLLM gives such templates:
    each image's and video's placeholder on its own line, then the texts joined by newlines."""
    parts = message["content"]
    if isinstance(parts, str):
        return message
    media = [_PLACEHOLDERS[p["type"]] for p in parts if p["type"] in _PLACEHOLDERS]
    texts = [p["text"] for p in parts if p["type"] == "text"]
    return message | {"content": "\n".join([*media, "\n".join(texts)] if media else texts)}


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    chat_template: str | None,
    chat_template_kwargs: dict[str, Any],
) -> RenderedChat:
    """The checkpoint's chat template over OpenAI-style or qwen-vl-utils-style messages. A value
    the template cannot use (a kwarg of the wrong type, say) is a ValueError naming the inputs,
    not Python's message."""
    reserved = sorted(RESERVED_TEMPLATE_ARGUMENTS & set(chat_template_kwargs))
    if reserved:
        raise ValueError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set; the server passes them")
    rendered, images, videos = parse_chat_messages(messages)
    if chat_template_kwargs.get("tools"):
        # As vLLM: a request with tools renders in the tokenizer's template (Qwen2.5-VL's is the
        # Qwen2.5 one, with tools, and takes each message's content as one string).
        whose = "this checkpoint's" if chat_template is None else "the given"
        chat_template = chat_template or tokenizer.tool_chat_template_source
        if chat_template is None or "tools" not in template_variables(chat_template):
            raise ValueError(f"tools: {whose} chat template does not take tools")
        if not _loops_over_content(chat_template):
            rendered = [_flattened(message) for message in rendered]
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt, chat_template, **chat_template_kwargs)
    except (TypeError, LookupError, AttributeError, ArithmeticError) as e:
        raise ValueError(
            f"the chat template could not render these messages and chat_template_kwargs ({type(e).__name__}): "
            "a value has the wrong type or is out of range"
        ) from None
    return RenderedChat(text, images, videos)


QWEN2_VL = ModelFamily(
    architecture=QWEN2_VL_ARCHITECTURE,
    model_type="qwen2_vl",
    name="qwen2_vl",
    display_name="Qwen2-VL",
    parse_config=parse_qwen2_vl_config,
    model_class=Qwen2VLForConditionalGeneration,
    load_tokenizer=Tokenizer,
    make_processing_info=make_processing_info,
    make_processor=make_processor,
    render_chat=render_chat,
    extra_eos_token_ids=no_extra_eos,
    # Boxes on the 0..1000 scale of the image, in the box tokens.
    grounding=GroundingConvention("qwen2-vl", "normalized", BOX_TOKENS),
    write_tiny=preset_writer("qwen2_vl", PRESETS, write_tiny_qwen2_vl, "flat or nested"),
    inspect_parts=INSPECT_PARTS,
    adapter_name=MERGER_NAME,
    transformers_class="Qwen2VLForConditionalGeneration",
)

# The processor, chat rendering and checkpoint layout are Qwen2-VL's.
QWEN2_5_VL = dataclasses.replace(
    QWEN2_VL,
    architecture=QWEN2_5_VL_ARCHITECTURE,
    model_type="qwen2_5_vl",
    name="qwen2_5_vl",
    display_name="Qwen2.5-VL",
    parse_config=parse_qwen2_5_vl_config,
    model_class=Qwen2_5_VLForConditionalGeneration,
    # Boxes in the resized image's pixels, mostly as JSON ("bbox_2d").
    grounding=GroundingConvention("qwen2.5-vl", "resized_pixels", BOX_TOKENS),
    write_tiny=preset_writer("qwen2_5_vl", PRESETS, write_tiny_qwen2_vl, "flat or nested"),
    transformers_class="Qwen2_5_VLForConditionalGeneration",
)
