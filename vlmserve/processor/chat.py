"""Chat messages in the two shapes users send, OpenAI's and qwen-vl-utils', reduced to what the
chat template renders plus the lists of images and of videos in order.

OpenAI:          {"type": "image_url", "image_url": {"url": "data:image/png;base64,...", "detail": "low"}}
                 {"type": "video_url", "video_url": {"url": "https://.../a.mp4"}}
qwen-vl-utils:   {"type": "image", "image": "file:///a.jpg", "max_pixels": 200704}
                 {"type": "video", "video": "file:///a.mp4" or [frame, ...], "fps": 1, "max_pixels": ...}
both:            {"type": "text", "text": "..."}; or the whole content as one string
"""

from __future__ import annotations

from typing import Any

from vlmserve.multimodal.image import DETAILS, ImageSizing
from vlmserve.multimodal.video import VideoOptions
from vlmserve.processor.base import ImageInput, VideoInput

SIZING_KEYS = ("min_pixels", "max_pixels", "resized_height", "resized_width")
# The roles OpenAI's API names; any other non-empty string is passed to the template too (as vLLM
# does), and a template that cannot render it says so.
ROLES = ("system", "user", "assistant", "tool")
# What a message carries besides its content that the chat templates read: an assistant's tool
# calls (and reasoning), a tool answer's call id and name.
MESSAGE_FIELDS = ("tool_calls", "tool_call_id", "name", "reasoning_content")
MAX_ROLE_LENGTH = 64
MAX_UUID_LENGTH = 256


def _uuid(part: dict[str, Any], label: str) -> str | None:
    """vLLM's media uuid: the name a later part can reuse this item by."""
    value = part.get("uuid")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_UUID_LENGTH:
        raise ValueError(f"{label}: uuid must be a string of 1..{MAX_UUID_LENGTH} characters")
    return value


def _sizing(part: dict[str, Any], label: str) -> ImageSizing:
    values: dict[str, int] = {}
    for key in SIZING_KEYS:
        if key in part:
            value = part[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{label}: {key} must be a positive integer, got {value!r}")
            values[key] = value
    if ("resized_height" in values) != ("resized_width" in values):
        raise ValueError(f"{label}: resized_height and resized_width must be given together")
    detail = part.get("detail")
    if detail is not None and detail not in DETAILS:
        raise ValueError(f"{label}: detail must be one of {', '.join(DETAILS)}, got {str(detail)[:40]!r}")
    return ImageSizing(**values, detail=detail)


def _source_and_options(part: dict[str, Any], kind: str) -> tuple[object, dict[str, Any]]:
    """The media source of an OpenAI-style part ({"image_url": {"url": ...}}, options beside it or
    inside) or a qwen-vl-utils-style one ({"image": ...}, options beside it); kind: image / video."""
    if f"{kind}_url" in part:
        spec = part[f"{kind}_url"]
        options = dict(part)
        if isinstance(spec, dict):
            options.update(spec)
            spec = spec.get("url")
        return spec, options
    return part.get(kind), part


def _image_part(part: dict[str, Any], where: str, index: int) -> ImageInput:
    label = f"{where} (image {index + 1})"
    source, options = _source_and_options(part, "image")
    uuid = _uuid(part, label)
    if source is None or (isinstance(source, str) and not source):
        if uuid is None:
            raise ValueError(f"{label}: image part has no image or URL")
        source = None  # the item cached under `uuid`
    return ImageInput(source=source, sizing=_sizing(options, label), label=label, uuid=uuid)


def _video_part(part: dict[str, Any], where: str, index: int) -> VideoInput:
    label = f"{where} (video {index + 1})"
    source, options = _source_and_options(part, "video")
    uuid = _uuid(part, label)
    if source is None or (isinstance(source, (str, list)) and not source):
        if uuid is None:
            raise ValueError(f"{label}: video part has no video, URL or frames")
        source = None  # the item cached under `uuid`
    return VideoInput(source=source, options=VideoOptions.from_dict(options, label), label=label, uuid=uuid)


def parse_chat_messages(
    messages: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[ImageInput], list[VideoInput]]:
    """Validate `messages`; return them with content parts normalised for the chat template
    ({"type": "image"} / {"type": "video"} / {"type": "text", "text": ...}), the images and the
    videos, each in order of appearance."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    rendered: list[dict[str, Any]] = []
    images: list[ImageInput] = []
    videos: list[VideoInput] = []
    for mi, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{mi}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not 0 < len(role) <= MAX_ROLE_LENGTH:
            raise ValueError(
                f"messages[{mi}].role must be a string of 1..{MAX_ROLE_LENGTH} characters "
                f"({', '.join(ROLES)} or a role the chat template knows), got {role!r}"[:300]
            )
        extra = {key: message[key] for key in MESSAGE_FIELDS if message.get(key) is not None}
        content = message.get("content")
        if content is None:
            content = ""
        if isinstance(content, str):
            rendered.append({"role": role, "content": content, **extra})
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{mi}].content must be a string or a list of parts")
        parts: list[dict[str, Any]] = []
        for pi, part in enumerate(content):
            where = f"messages[{mi}].content[{pi}]"
            if isinstance(part, str):
                parts.append({"type": "text", "text": part})
                continue
            if not isinstance(part, dict):
                raise ValueError(f"{where} must be an object")
            kind = part.get("type")
            if kind == "text" or (kind is None and "text" in part):
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"{where}: text part needs a string 'text'")
                parts.append({"type": "text", "text": text})
            elif kind in ("image", "image_url") or (kind is None and ("image" in part or "image_url" in part)):
                images.append(_image_part(part, where, len(images)))
                parts.append({"type": "image"})
            elif kind in ("video", "video_url") or (kind is None and ("video" in part or "video_url" in part)):
                videos.append(_video_part(part, where, len(videos)))
                parts.append({"type": "video"})
            elif kind in ("audio", "input_audio", "audio_url") or "audio" in part:
                raise ValueError(f"{where}: this model has no audio input")
            else:
                raise ValueError(f"{where}: unsupported content part type {kind!r}")
        rendered.append({"role": role, "content": parts, **extra})
    return rendered, images, videos
