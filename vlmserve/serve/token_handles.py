"""Seed 004's contract: a list-of-dicts input becomes token ids that carry shared-memory handles.

`tokenize(frontend, inputs)` takes [{"text": ...}, {"image": path or URL}, ...], writes each
image's pixel patches to a shared-memory segment, and returns the prompt's token ids with the
first two placeholder positions of every image replaced by the segment's handle and the image's
grid, each encoded as an int64 (vlmserve.serve.shm). `decode(ids, ...)` is the engine's inverse:
it reads and unlinks the segments, puts the placeholder ids back and returns the images as
MultiModalItems. Segments are released whatever happens.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import numpy as np
import torch

from vlmserve.config import ModelConfig
from vlmserve.engine.frontend import Frontend
from vlmserve.multimodal.inputs import MultiModalItem
from vlmserve.processor.base import ImageInput
from vlmserve.serve import shm

MODALITIES = ("image", "video", "audio", "text")


def list_format_to_messages(inputs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageInput]]:
    """The list-of-dicts format as one user turn (content parts in order), and its images."""
    if not isinstance(inputs, list) or not inputs:
        raise ValueError("inputs must be a non-empty list of dicts")
    parts: list[dict[str, Any]] = []
    images: list[ImageInput] = []
    for i, entry in enumerate(inputs):
        if not isinstance(entry, dict) or len(entry) != 1 or next(iter(entry)) not in MODALITIES:
            raise ValueError(f"inputs[{i}] must be a dict with exactly one key of {', '.join(MODALITIES)}")
        ((kind, value),) = entry.items()
        if kind == "audio":
            raise ValueError(f"inputs[{i}]: this model has no audio input")
        if kind == "video":
            raise ValueError(f"inputs[{i}]: video input is not supported yet")
        if kind == "text":
            if not isinstance(value, str):
                raise ValueError(f"inputs[{i}].text must be a string")
            parts.append({"type": "text", "text": value})
        else:
            images.append(ImageInput(value, label=f"inputs[{i}].image"))
            parts.append({"type": "image"})
    return [{"role": "user", "content": parts}], images


def tokenize(frontend: Frontend, inputs: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the chat-templated prompt, with every image's pixels in shared memory and
    its segment handle and grid in its first two placeholder positions. The engine unlinks the
    segments when it reads them; a caller that never submits the ids must call `release(ids)`."""
    if not frontend.family.token_handles:
        raise ValueError(frontend.family.token_handles_refusal)
    messages, images = list_format_to_messages(inputs)
    text = frontend.tokenizer.apply_chat_template(messages, add_generation_prompt)
    prompt = frontend.processor.process(text, images)
    ids = list(prompt.prompt_token_ids)
    written: list[str] = []
    try:
        for k, item in enumerate(prompt.mm_items):
            if item.length < 2:
                raise ValueError(f"inputs image {k + 1}: one placeholder token cannot carry a segment handle and grid")
            segment = shm.write_array(item.pixel_values.numpy())
            written.append(segment.name)
            ids[item.offset] = shm.name_to_handle(segment.name)
            ids[item.offset + 1] = shm.grid_to_int64(item.grid_thw)
    except BaseException:
        for name in written:
            shm.unlink(name)
        raise
    return ids


def _handle_positions(ids: list[int], vision_start: int) -> list[int]:
    return [p + 1 for p in range(len(ids) - 2) if ids[p] == vision_start and ids[p + 1] >= 1 << 61]


def release(ids: list[int], config: ModelConfig) -> None:
    """Unlink every segment the ids point at (ids that will never reach the engine)."""
    for p in _handle_positions(ids, config.vision_start_token_id):
        with contextlib.suppress(shm.ShmError):
            shm.unlink(shm.handle_to_name(ids[p]))


def decode(ids: list[int], config: ModelConfig) -> tuple[list[int], list[MultiModalItem]]:
    """The engine side: segments read (and unlinked), placeholders restored, items built."""
    positions = _handle_positions(ids, config.vision_start_token_id)
    names = []
    for p in positions:
        try:
            names.append(shm.handle_to_name(ids[p]))
        except shm.ShmError:
            release(ids, config)
            raise
    ids = list(ids)
    items = []
    merge = config.vision.spatial_merge_size
    try:
        for p, name in zip(positions, names, strict=True):
            t, h, w = shm.int64_to_grid(ids[p + 1])
            length = t * h * w // merge**2
            end = p + length
            if end >= len(ids) or ids[end] != config.vision_end_token_id:
                raise shm.ShmError(f"grid ({t}, {h}, {w}) does not match the placeholder run at token {p}")
            if any(tok != config.image_token_id for tok in ids[p + 2 : end]):
                raise shm.ShmError(f"the placeholder run at token {p} holds other tokens")
            pixels = shm.read_and_unlink(shm.Segment(name, (t * h * w, config.vision.patch_dim)))
            ids[p:end] = [config.image_token_id] * length
            items.append(
                MultiModalItem(
                    modality="image",
                    offset=p,
                    length=length,
                    grid_thw=(t, h, w),
                    content_hash=hashlib.blake2b(pixels.tobytes(), digest_size=16).hexdigest(),
                    pixel_values=torch.from_numpy(np.ascontiguousarray(pixels)),
                    original_size=(w * config.vision.patch_size, h * config.vision.patch_size),
                    resized_size=(w * config.vision.patch_size, h * config.vision.patch_size),
                )
            )
    finally:
        for name in names:
            shm.unlink(name)
    return ids, items
