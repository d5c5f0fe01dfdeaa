"""Tools in the chat templates: a request with tools renders in the tokenizer's template (the
Qwen2.5 one Qwen2.5-VL publish in tokenizer_config.json), with images as their placeholders on
their own lines; a template without tools refuses them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlmserve.families.qwen2_vl.family import render_chat
from vlmserve.families.qwen2_vl.tiny import QWEN2_5_CHAT_TEMPLATE, QWEN2_VL_CHAT_TEMPLATE
from vlmserve.tokenizer import Tokenizer, template_variables

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
HISTORY = [
    {"role": "user", "content": "Call f."},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "done"},
]


def test_the_tiny_qwen2_5_vl_is_laid_out_as_published(tiny25_dir: Path) -> None:
    assert json.loads((tiny25_dir / "chat_template.json").read_text())["chat_template"] == QWEN2_VL_CHAT_TEMPLATE
    assert json.loads((tiny25_dir / "tokenizer_config.json").read_text())["chat_template"] == QWEN2_5_CHAT_TEMPLATE
    assert "tools" in template_variables(QWEN2_5_CHAT_TEMPLATE)
    assert "tools" not in template_variables(QWEN2_VL_CHAT_TEMPLATE)


def test_tools_render_in_the_tokenizer_s_template(tiny25_dir: Path) -> None:
    # (tests/api/test_tool_calls_server.py checks these prompts against transformers' tokenizer.)
    tokenizer = Tokenizer(tiny25_dir)
    ours = render_chat(tokenizer, HISTORY, True, None, {"tools": TOOLS}).prompt
    assert ours.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.")
    assert '\n<tools>\n{"type": "function", "function": {"name": "f", ' in ours
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>' in ours
    assert ours.endswith("<|im_start|>user\n<tool_response>\ndone\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # Without tools: the vision template of chat_template.json, as before.
    plain = render_chat(tokenizer, HISTORY[:1], True, None, {}).prompt
    assert plain.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")


def test_images_under_a_string_content_template_are_placeholders(tiny25_dir: Path) -> None:
    message = {"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "What?"}]}
    chat = render_chat(Tokenizer(tiny25_dir), [message], True, None, {"tools": TOOLS})
    assert chat.prompt.endswith(
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>\nWhat?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert len(chat.images) == 1


def test_a_template_without_tools_refuses_them(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="^tools: this checkpoint's chat template does not take tools"):
        render_chat(Tokenizer(tiny_dir), HISTORY[:1], True, None, {"tools": TOOLS})
