"""Qwen-VL-Chat's chat format: make_context's chatml prompt, the list format of images,
boxes and text, and the bridge from OpenAI-style messages.

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n
    <|im_start|>user\\nPicture 1: <img>demo.jpeg</img>\\n这是什么<|im_end|>\\n
    <|im_start|>assistant\\n图中是一名年轻女子...<|im_end|>\\n
    <|im_start|>user\\n输出"击掌"的检测框<|im_end|>\\n
    <|im_start|>assistant\\n

Each turn's role and content are encoded apart (role, "\\n", content), with only the image and
box tags (IMAGE_ST) special inside content: "<|im_start|>" typed by a user stays text. The
oldest history turns are dropped while system + history would reach max_window_size tokens; the
query is always kept. Generation stops at <|im_end|> or <|im_start|> (STOP_WORDS); the model's
end of text is <|endoftext|>, which the reference emits right after <|im_end|>.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vlmserve.families.qwen_vl.tokens import (
    ALL_SPECIAL_TOKENS,
    BOX_END,
    BOX_START,
    IM_END,
    IM_START,
    IMAGE_END,
    IMAGE_ST,
    IMAGE_START,
    IMG_TOKEN_SPAN,
    QUAD_END,
    QUAD_START,
    REF_END,
    REF_START,
)
from vlmserve.processor.base import ImageInput


class QwenVLTokenizer(Protocol):
    """What the chat format needs of the tokenizer (tokenizer.py imports this module, not the
    other way round)."""

    im_start_id: int
    im_end_id: int
    img_start_id: int
    max_window_size: int

    def encode(self, text: str, allowed_special: Any = ...) -> list[int]: ...


DEFAULT_SYSTEM = "You are a helpful assistant."  # QWenLMHeadModel.chat's default
DEFAULT_MAX_WINDOW_SIZE = 6144  # generation_config.json
STOP_WORDS = (IM_END, IM_START)  # chat()'s stop_words_ids, in its order

History = list[tuple[str, str | None]]


def stop_token_ids(tokenizer: QwenVLTokenizer) -> list[int]:
    """Ids that end a chat answer (chat()'s stop_words_ids): <|im_end|>, <|im_start|>."""
    return [tokenizer.im_end_id, tokenizer.im_start_id]


# -- make_context ---------------------------------------------------------------------------------


def _make_context(
    tokenizer: QwenVLTokenizer, query: str, history: History, system: str, max_window_size: int
) -> tuple[str, list[int], int]:
    """make_context for chatml, plus how many of the newest history turns it kept."""
    im_start, im_end = [tokenizer.im_start_id], [tokenizer.im_end_id]
    nl = tokenizer.encode("\n")
    allowed = set(IMAGE_ST)

    def tokenize_str(role: str, content: str) -> tuple[str, list[int]]:
        return f"{role}\n{content}", tokenizer.encode(role, allowed) + nl + tokenizer.encode(content, allowed)

    system_text, system_part = tokenize_str("system", system)
    system_tokens = im_start + system_part + im_end

    raw_text = ""
    context_tokens: list[int] = []
    kept = 0
    for turn_query, turn_response in reversed(history):
        query_text, query_part = tokenize_str("user", turn_query)
        query_tokens = im_start + query_part + im_end
        if turn_response is not None:
            response_text, response_part = tokenize_str("assistant", turn_response)
            response_tokens = im_start + response_part + im_end
            next_context_tokens = nl + query_tokens + nl + response_tokens
            prev_chat = f"\n{IM_START}{query_text}{IM_END}\n{IM_START}{response_text}{IM_END}"
        else:
            next_context_tokens = nl + query_tokens + nl
            prev_chat = f"\n{IM_START}{query_text}{IM_END}\n"
        # NOTE: strictly below the window, and the first turn that does not fit ends the history.
        if len(system_tokens) + len(next_context_tokens) + len(context_tokens) < max_window_size:
            context_tokens = next_context_tokens + context_tokens
            raw_text = prev_chat + raw_text
            kept += 1
        else:
            break

    context_tokens = system_tokens + context_tokens
    raw_text = f"{IM_START}{system_text}{IM_END}" + raw_text
    context_tokens += nl + im_start + tokenize_str("user", query)[1] + im_end + nl + im_start
    context_tokens += tokenizer.encode("assistant") + nl
    raw_text += f"\n{IM_START}user\n{query}{IM_END}\n{IM_START}assistant\n"
    return raw_text, context_tokens, kept


def make_context(
    tokenizer: QwenVLTokenizer,
    query: str,
    history: History | None = None,
    system: str = "",
    max_window_size: int = DEFAULT_MAX_WINDOW_SIZE,
    chat_format: str = "chatml",
) -> tuple[str, list[int]]:
    """(raw_text, context_tokens) exactly as the remote code's make_context. "raw" is the query
    alone, as there."""
    if chat_format == "raw":
        return query, tokenizer.encode(query)
    if chat_format != "chatml":
        raise ValueError(f"unknown chat_format {chat_format!r}; Qwen-VL-Chat uses 'chatml'")
    raw_text, context_tokens, _ = _make_context(tokenizer, query, list(history or []), system, max_window_size)
    return raw_text, context_tokens


# -- list format ----------------------------------------------------------------------------------


def _coords(value: Any, count: int, what: str) -> list[list[Any]]:
    """A list of `count`-number shapes: [[x1, y1, x2, y2], ...] as the remote code takes a box, or
    one flat shape [x1, y1, x2, y2] (the reference's own example)."""
    if isinstance(value, (list, tuple)) and len(value) == count and all(isinstance(v, (int, float)) for v in value):
        shapes = [list(value)]
    elif isinstance(value, (list, tuple)) and all(
        isinstance(s, (list, tuple)) and len(s) == count and all(isinstance(v, (int, float)) for v in s) for s in value
    ):
        shapes = [list(s) for s in value]
    else:
        raise ValueError(f"a {what} is {count} numbers or a list of such, got {value!r}")
    # Written as %d: an infinite or NaN coordinate has no integer.
    if any(isinstance(v, float) and not math.isfinite(v) for shape in shapes for v in shape):
        raise ValueError(f"a {what}'s coordinates must be finite numbers, got {value!r}")
    return shapes


def from_list_format(list_format: list[dict[str, Any]], first_picture: int = 1) -> str:
    """The remote QWenTokenizer.from_list_format: images become "Picture N: <img>URL</img>\\n"
    (N counting from `first_picture`), text is kept, a box "<ref>name</ref><box>(x1,y1),(x2,y2)</box>"
    with coordinates as %d. Also taken, beyond the remote code: a box given as one flat
    [x1, y1, x2, y2] or as its "(x1,y1),(x2,y2)" text (what to_list_format returns), a quad
    ({"quad": [x1, y1, ..., x4, y4] or text, "ref": ...}) and a ref alone."""
    text = ""
    num_images = first_picture - 1
    for ele in list_format:
        if not isinstance(ele, dict):
            raise ValueError(f"Unsupported element: {ele!r}")
        if "image" in ele:
            if not isinstance(ele["image"], str):
                raise ValueError(f"an image element needs a path or URL string, got {type(ele['image']).__name__}")
            num_images += 1
            text += f"Picture {num_images}: {IMAGE_START}{ele['image']}{IMAGE_END}\n"
        elif "text" in ele:
            text += str(ele["text"])
        elif "box" in ele or "quad" in ele:
            key, count, start, end = (
                ("box", 4, BOX_START, BOX_END) if "box" in ele else ("quad", 8, QUAD_START, QUAD_END)
            )
            if "ref" in ele:
                text += REF_START + str(ele["ref"]) + REF_END
            if isinstance(ele[key], str):
                text += start + ele[key] + end
                continue
            for shape in _coords(ele[key], count, key):
                # int() truncates as the remote code's %d does.
                points = ",".join(f"({int(shape[i])},{int(shape[i + 1])})" for i in range(0, count, 2))
                text += start + points + end
        elif "ref" in ele:
            text += REF_START + str(ele["ref"]) + REF_END
        else:
            raise ValueError(f"Unsupported element: {ele!r}")
    return text


_TAGS = {IMAGE_START: (IMAGE_END, "image"), REF_START: (REF_END, "ref"), BOX_START: (BOX_END, "box")}
_TAGS[QUAD_START] = (QUAD_END, "quad")
_START_TAG = re.compile("|".join(map(re.escape, _TAGS)))


def to_list_format(text: str) -> list[dict[str, str]]:
    """The remote QWenTokenizer.to_list_format: `text` (NFC) cut into {"text": ...} pieces and
    {"image" | "ref" | "box" | "quad": what stood between the tags}, in order. Each start tag closes
    at the next matching end tag; an unclosed one is a ValueError. Joining the pieces back (tags
    around the tagged ones) gives the text again."""
    text = unicodedata.normalize("NFC", text)
    items: list[dict[str, str]] = []
    end = 0
    while (match := _START_TAG.search(text, end)) is not None:
        if match.start() > end:
            items.append({"text": text[end : match.start()]})
        close, key = _TAGS[match.group()]
        stop = text.find(close, match.end())
        if stop < 0:
            raise ValueError(f"unclosed {match.group()} at character {match.start()}")
        items.append({key: text[match.end() : stop]})
        end = stop + len(close)
    if end < len(text):
        items.append({"text": text[end:]})
    return items


# -- OpenAI-style messages ------------------------------------------------------------------------

_SIZING_KEYS = ("min_pixels", "max_pixels", "resized_height", "resized_width")
_ANY_SPECIAL = re.compile("|".join(map(re.escape, ALL_SPECIAL_TOKENS)))
_INLINE_IMAGE = re.compile(re.escape(IMAGE_START) + "(.*?)" + re.escape(IMAGE_END), re.DOTALL)


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # make_context's raw_text
    token_ids: list[int]  # make_context's context_tokens: encode(text) may differ (turns are encoded apart)
    # One per <img> span of token_ids, in order. Empty when the messages named no image sources
    # ({"type": "image"} parts as parse_chat_messages renders them): the caller passes its own.
    images: list[ImageInput]


def _span_text(source: object) -> str:
    """What an image part writes between <img> and </img>: its path or URL when that fits the
    256 bytes and holds no tag, else nothing. The model never sees these bytes (the image's
    features replace them); the processor loads the images the ChatPrompt lists."""
    if isinstance(source, Path):
        source = str(source)
    if isinstance(source, str) and len(source.encode()) <= IMG_TOKEN_SPAN and not _ANY_SPECIAL.search(source):
        return unicodedata.normalize("NFC", source)
    return ""


def _image_source(part: dict[str, Any], where: str) -> object:
    if any(key in part for key in _SIZING_KEYS):
        raise ValueError(
            f"{where}: Qwen-VL-Chat resizes every image to 448x448; {', '.join(_SIZING_KEYS)} do not apply"
        )
    if "image_url" in part:
        spec = part["image_url"]
        return spec.get("url") if isinstance(spec, dict) else spec
    return part.get("image")


class _Pictures:
    """Numbers images across the whole conversation (Qwen-VL's web demo), and turns each
    message's content into its text and the images that text holds (None: no source named)."""

    def __init__(self) -> None:
        self.pictures = 0

    def content_text(self, content: Any, where: str) -> tuple[str, list[ImageInput | None]]:
        if content is None:
            content = ""
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise ValueError(f"{where} must be a string or a list of parts")
        text = ""
        images: list[ImageInput | None] = []
        for pi, part in enumerate(content):
            at = f"{where}[{pi}]"
            if isinstance(part, str):
                part = {"type": "text", "text": part}
            if not isinstance(part, dict):
                raise ValueError(f"{at} must be an object")
            kind = part.get("type")
            if kind == "text" or (kind is None and "text" in part):
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{at}: text part needs a string 'text'")
                # Inline <img>URL</img> in text is a span too (the remote tokenizer allows the tags).
                for url in _INLINE_IMAGE.findall(unicodedata.normalize("NFC", part["text"])):
                    images.append(ImageInput(url, label=f"{at} (<img>{url}</img>)") if url else None)
                text += part["text"]
            elif kind in ("image", "image_url") or (kind is None and ("image" in part or "image_url" in part)):
                source = _image_source(part, at)
                self.pictures += 1
                label = f"{at} (image {self.pictures})"
                empty = source is None or (isinstance(source, str) and not source)
                images.append(None if empty else ImageInput(source, label=label))
                text += from_list_format([{"image": _span_text(source)}], first_picture=self.pictures)
            elif kind in ("video", "video_url") or "video" in part or "video_url" in part:
                raise ValueError(f"{at}: Qwen-VL-Chat has no video input")
            elif kind is None and any(key in part for key in ("box", "quad", "ref")):
                text += from_list_format([part])
            else:
                raise ValueError(f"{at}: unsupported content part type {kind!r}")
        return text, images


def chat_prompt(
    tokenizer: QwenVLTokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    system: str | None = None,
    max_window_size: int | None = None,
) -> ChatPrompt:
    """OpenAI-style `messages` as QWenLMHeadModel.chat would prompt them: a system message (else
    `system`, else "You are a helpful assistant.") is the system; user/assistant pairs before the
    last user message are the history; the last user message is the query. Images are written
    "Picture N: <img>...</img>\\n", numbered across the whole conversation (Qwen-VL's web demo).
    Consecutive messages of one role are joined by a newline. Content: a string, or parts
    {"type": "text"}, {"type": "image_url", "image_url": {"url"}}, {"type": "image", "image"},
    or Qwen-VL's own [{"image": ...}, {"text": ...}, {"box": ..., "ref": ...}]. Without
    `add_generation_prompt` the prompt stops before "<|im_start|>assistant\\n"."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    pictures = _Pictures()
    system_parts: list[str] = []
    turns: list[tuple[str, str, list[ImageInput | None]]] = []
    for mi, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{mi}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"messages[{mi}].role must be system, user or assistant for Qwen-VL-Chat, got {role!r}")
        text, images = pictures.content_text(message.get("content"), f"messages[{mi}].content")
        if role == "system":
            if turns:
                raise ValueError(f"messages[{mi}]: the system message must come before the conversation")
            if images:
                raise ValueError(f"messages[{mi}]: a system message cannot hold images")
            system_parts.append(text)
        elif turns and turns[-1][0] == role:
            _, previous, previous_images = turns[-1]
            joined = previous if not previous or previous.endswith("\n") else previous + "\n"
            turns[-1] = (role, joined + text, previous_images + images)
        else:
            turns.append((role, text, images))
    if not turns or turns[0][0] != "user":
        raise ValueError("the conversation must start with a user message (after any system message)")
    if turns[-1][0] != "user":
        raise ValueError("the conversation must end with a user message: Qwen-VL-Chat answers the last question")

    history: History = [(turns[i][1], turns[i + 1][1]) for i in range(0, len(turns) - 1, 2)]
    window = tokenizer.max_window_size if max_window_size is None else max_window_size
    system_text = "\n".join(system_parts) if system_parts else (DEFAULT_SYSTEM if system is None else system)
    text, token_ids, kept = _make_context(tokenizer, turns[-1][1], history, system_text, window)
    # Images of the history turns make_context kept, then the query's.
    first_kept = len(turns) - 1 - 2 * kept
    images = [image for _, _, turn_images in turns[first_kept:] for image in turn_images]
    if not add_generation_prompt:
        suffix = f"{IM_START}assistant\n"
        assert text.endswith(suffix)
        text = text[: -len(suffix)]
        suffix_ids = [tokenizer.im_start_id, *tokenizer.encode("assistant"), *tokenizer.encode("\n")]
        assert token_ids[-len(suffix_ids) :] == suffix_ids
        token_ids = token_ids[: -len(suffix_ids)]
    if token_ids.count(tokenizer.img_start_id) != len(images):
        raise ValueError(
            f"the prompt holds {token_ids.count(tokenizer.img_start_id)} <img> spans for {len(images)} images"
        )
    if all(image is None for image in images):
        return ChatPrompt(text, token_ids, [])
    if any(image is None for image in images):
        raise ValueError(
            "every image needs its source (a path, URL or image) when any has one; an empty <img></img> "
            "or {'type': 'image'} part names none"
        )
    return ChatPrompt(text, token_ids, [image for image in images if image is not None])
