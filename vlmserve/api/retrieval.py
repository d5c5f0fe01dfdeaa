"""Conversations of the Qwen3 retrieval models, built as their official scripts build them
(scripts/qwen3_vl_embedding.py and scripts/qwen3_vl_reranker.py in the Qwen3-VL-Embedding and
Qwen3-VL-Reranker repositories); the chat template renders them with the generation prompt.

Embedding: a system message holding the instruction (default "Represent the user's input."; a
given one is stripped and gets a full stop when it ends in no punctuation), then a user message of
the input's videos, images and text ("NULL" where it has none). The last token of the rendered
prompt is the "\\n" after "<|im_start|>assistant", whose hidden state is the embedding.

Reranker: a system message asking for "yes" or "no", then one user message: "<Instruct>:
{instruction}", "<Query>:", the query's videos, images, text, "\\n<Document>:", the document's.

An input is a string (text), the official scripts' object {"text": ..., "image": ..., "video": ...}
(each optional; "image" one or a list, "video" one video: a path, URL or list of frames; the
video, images, then text, as the scripts order them, bounded as they bound them; "fps": the
video's sampling rate, or a list of frames' rate, default 1), or a list of content parts / vLLM's {"content": [parts]}
(OpenAI's image_url / video_url or qwen-vl-utils' image / video, in the order given)."""

from __future__ import annotations

import unicodedata
from typing import Any

EMBEDDING_INSTRUCTION = "Represent the user's input."
RERANKER_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the "
    'answer can only be "yes" or "no".'
)
RERANKER_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."
# The official scripts' image bounds (resized with factor 32: patch 16, merge 2), and video options.
MIN_PIXELS = 4 * 32 * 32
EMBEDDING_MAX_PIXELS = 1800 * 32 * 32
RERANKER_MAX_PIXELS = 1280 * 32 * 32
VIDEO_FPS = 1.0
VIDEO_MAX_FRAMES = 64
EMBEDDING_VIDEO_TOTAL_PIXELS = 10 * 768 * 32 * 32

Message = dict[str, Any]
OBJECT_KEYS = ("text", "image", "video", "fps", "instruction")


def embedding_conversation(item: object, instruction: str | None = None, where: str = "input") -> list[Message]:
    """An embedding model's conversation for one input (its "instruction", where an object gives
    one, over `instruction`)."""
    if isinstance(item, dict) and item.get("instruction") is not None:
        instruction = _text(item["instruction"], f"{where}.instruction")
    if instruction is not None:
        instruction = instruction.strip()
        if instruction and not unicodedata.category(instruction[-1]).startswith("P"):
            instruction += "."
    return [
        {"role": "system", "content": [{"type": "text", "text": instruction or EMBEDDING_INSTRUCTION}]},
        {"role": "user", "content": content_parts(item, where, EMBEDDING_MAX_PIXELS)},
    ]


def reranker_conversation(
    query: object, document: object, instruction: str | None = None, where: tuple[str, str] = ("query", "document")
) -> list[Message]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "<Instruct>: " + (instruction or RERANKER_INSTRUCTION)}]
    content += [{"type": "text", "text": "<Query>:"}, *content_parts(query, where[0], RERANKER_MAX_PIXELS)]
    content += [{"type": "text", "text": "\n<Document>:"}, *content_parts(document, where[1], RERANKER_MAX_PIXELS)]
    return [
        {"role": "system", "content": [{"type": "text", "text": RERANKER_SYSTEM}]},
        {"role": "user", "content": content},
    ]


def is_content_parts(value: object) -> bool:
    """A list of content parts (one multimodal query or document), not a list of inputs."""
    return isinstance(value, list) and bool(value) and all(isinstance(p, dict) and "type" in p for p in value)


def content_parts(item: object, where: str, max_pixels: int) -> list[dict[str, Any]]:
    """One input as chat content parts (see the module's docstring)."""
    if isinstance(item, str):
        return [{"type": "text", "text": item or "NULL"}]
    if isinstance(item, dict) and "content" in item and set(item) <= {"content"}:
        item = item["content"]
    if isinstance(item, list):
        if not item:
            raise ValueError(f"{where}: an empty list of content parts")
        for k, part in enumerate(item):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ValueError(f"{where}[{k}]: a content part is an object with a 'type'")
        return list(item)
    if not isinstance(item, dict):
        raise ValueError(
            f"{where} must be a string, an object with any of {list(OBJECT_KEYS[:3])}, or a list of content parts; "
            f"got {type(item).__name__}"
        )
    unknown = set(item) - set(OBJECT_KEYS)
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)}; known: {list(OBJECT_KEYS)}")
    parts: list[dict[str, Any]] = []
    video = item.get("video")
    if video is not None:
        total = EMBEDDING_VIDEO_TOTAL_PIXELS if max_pixels == EMBEDDING_MAX_PIXELS else 4 * 2 * max_pixels
        fps = item.get("fps", VIDEO_FPS)
        # A file is sampled at fps (at most VIDEO_MAX_FRAMES frames); a list of frames is used as
        # given, fps saying how many of them make a second.
        sampling = (
            {"sample_fps": fps} if isinstance(video, (list, tuple)) else {"fps": fps, "max_frames": VIDEO_MAX_FRAMES}
        )
        parts.append({"type": "video", "video": video, **sampling, "min_pixels": MIN_PIXELS, "total_pixels": total})
    parts += [
        {"type": "image", "image": image, "min_pixels": MIN_PIXELS, "max_pixels": max_pixels}
        for image in _several(item.get("image"))
    ]
    text = item.get("text")
    if text is not None:
        text = _text(text, f"{where}.text")
    if text:
        parts.append({"type": "text", "text": text})
    return parts or [{"type": "text", "text": "NULL"}]


def _several(value: object) -> list[object]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string, got {type(value).__name__}")
    return value
