"""The list-of-dicts input (Qwen's [{"text": ...}, {"image": path or URL}, {"video": ...}]) in the
API process: rendered as one user turn the way the family's chat does, each item's pixels written
to a shared-memory segment, and the prompt's token ids returned with the segment's handle at the
item's first placeholder position, followed by the values the family's layout puts there (its
processing info's handle_payload: a grid or shape, a video's seconds; vlmserve.multimodal.handles
encodes them). The engine's inverse is vlmserve.ipc.token_handles.decode."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from vlmserve.api.frontend import Frontend
from vlmserve.ipc import shm
from vlmserve.processor.base import ImageInput, VideoInput

MODALITIES = ("image", "video", "audio", "text")
_PART = re.compile(r"messages\[0\]\.content\[(\d+)\]")


def list_format_to_messages(inputs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """The list-of-dicts format as one user turn (content parts in order), and the labels of its
    images and of its videos (inputs[i].image), in order."""
    if not isinstance(inputs, list) or not inputs:
        raise ValueError("inputs must be a non-empty list of dicts")
    parts: list[dict[str, Any]] = []
    labels: dict[str, list[str]] = {"image": [], "video": []}
    for i, entry in enumerate(inputs):
        if not isinstance(entry, dict) or len(entry) != 1 or next(iter(entry)) not in MODALITIES:
            raise ValueError(f"inputs[{i}] must be a dict with exactly one key of {', '.join(MODALITIES)}")
        ((kind, value),) = entry.items()
        if kind == "audio":
            raise ValueError(f"inputs[{i}].audio: this model has no audio input (image, video and text only)")
        if kind == "text" and not isinstance(value, str):
            raise ValueError(f"inputs[{i}].text must be a string")
        if kind != "text":
            labels[kind].append(f"inputs[{i}].{kind}")
        parts.append({"type": kind, kind: value})
    return [{"role": "user", "content": parts}], labels


def tokenize(frontend: Frontend, inputs: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the prompt the family's chat renders for `inputs`, with every item's pixels in
    shared memory and its handle in its placeholders. The engine unlinks the segments when it
    reads them; a caller that never submits the ids must call `release(ids, processor)`."""
    messages, labels = list_format_to_messages(inputs)
    try:
        chat = frontend.render_chat(messages, add_generation_prompt)
    except ValueError as e:  # name the input, not the message it became
        raise type(e)(_PART.sub(r"inputs[\1]", str(e))) from None
    if [len(chat.images), len(chat.videos)] != [len(labels["image"]), len(labels["video"])]:
        labels = {"image": [i.label for i in chat.images], "video": [v.label for v in chat.videos]}  # inline <img>
    images = [ImageInput(i.source, i.sizing, label) for i, label in zip(chat.images, labels["image"], strict=True)]
    videos = [VideoInput(v.source, v.options, label) for v, label in zip(chat.videos, labels["video"], strict=True)]
    processor = frontend.processor
    prompt = processor.process(chat.prompt, images, videos)
    ids = list(prompt.prompt_token_ids)
    written: list[str] = []
    try:
        for k, item in enumerate(prompt.mm_items):
            array, values = processor.handle_payload(item)
            if item.length < 1 + len(values):
                raise ValueError(
                    f"{item.modality} {k + 1}: {item.length} placeholder token(s) cannot carry a segment handle and "
                    f"{len(values)} value(s); send a larger {item.modality}"
                )
            segment = shm.write_array(np.asarray(array, dtype=np.float32))
            written.append(segment.name)
            ids[item.offset] = shm.name_to_handle(segment.name)
            ids[item.offset + 1 : item.offset + 1 + len(values)] = values
    except BaseException:
        for name in written:
            shm.unlink(name)
        raise
    return ids
