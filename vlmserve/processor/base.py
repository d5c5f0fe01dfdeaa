"""What every family's processor takes and offers, named without any family: the user's images
and videos with their options, the per-prompt limits, and the `Processor` protocol the engine,
the server and the entrypoints call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from vlmserve.multimodal.image import ImageSizing
from vlmserve.multimodal.inputs import MultiModalItem, ProcessedPrompt
from vlmserve.multimodal.media import MediaLimits
from vlmserve.multimodal.video import VideoOptions


@dataclass(frozen=True)
class ImageInput:
    """One image as the user gave it: a path, URL, bytes or PIL image, and its resize options."""

    source: object
    sizing: ImageSizing = field(default_factory=ImageSizing)
    label: str = "image"
    # vLLM's media uuid: the item can be reused by it later (source None: reuse the cached one).
    uuid: str | None = None


@dataclass(frozen=True)
class VideoInput:
    """One video as the user gave it: a path, URL or bytes of a file, or a list of frames (or a
    uint8 array [frames, height, width, 3]), and its qwen-vl-utils options."""

    source: object
    options: VideoOptions = field(default_factory=VideoOptions)
    label: str = "video"
    uuid: str | None = None


# A video costs hundreds to thousands of tokens: one per prompt unless asked for.
DEFAULT_LIMIT_MM_PER_PROMPT = {"image": 8, "video": 1}


@dataclass(frozen=True)
class ProcessorLimits:
    max_model_len: int
    # Items of each modality one prompt may hold (vLLM's limit_mm_per_prompt); a modality left out
    # gets its DEFAULT_LIMIT_MM_PER_PROMPT.
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_LIMIT_MM_PER_PROMPT))

    def limit(self, modality: str) -> int:
        return self.limit_mm_per_prompt.get(modality, DEFAULT_LIMIT_MM_PER_PROMPT[modality])


@dataclass
class RenderedChat:
    """A conversation as the processor takes it: the prompt (text, or token ids for a family whose
    turns are encoded one by one) and the images and videos in order."""

    prompt: str | list[int]
    images: list[ImageInput] = field(default_factory=list)
    videos: list[VideoInput] = field(default_factory=list)


class ProcessingInfo(Protocol):
    """What the engine needs of a family's processor, without a tokenizer (the engine process
    loads none): the admitted limits, worst-case dummy inputs for memory planning (vLLM's processing
    info and dummy builder), and prompts rebuilt from token ids and items processed elsewhere (the
    API process, a token-handle prompt)."""

    media_limits: MediaLimits

    def max_items_per_prompt(self) -> dict[str, int]: ...

    def max_tokens_per_item(self) -> dict[str, int]: ...

    def dummy_items(self, count: int, tokens_per_item: int, modality: str = "image") -> list[MultiModalItem]: ...

    def from_token_ids(self, token_ids: list[int], items: list[MultiModalItem]) -> ProcessedPrompt:
        """Spans checked against the items, positions rebuilt."""
        ...

    # The list-of-dicts input: an item may travel as a shared-memory segment whose handle sits at the item's
    # first placeholder (item.offset), followed by the values handle_payload gives
    # (vlmserve.multimodal.handles); vlmserve.ipc.token_handles does the shared-memory part.

    def handle_payload(self, item: MultiModalItem) -> tuple[np.ndarray, list[int]]:
        """The array to put in the item's segment and the int64 values written after its handle."""
        ...

    def handle_positions(self, token_ids: Sequence[int]) -> list[int]:
        """Where the prompt's segment handles are, in order."""
        ...

    def item_from_handle(
        self, token_ids: list[int], position: int, read: Callable[[tuple[int, ...]], np.ndarray]
    ) -> MultiModalItem:
        """The item whose handle is at `position`: the values after it checked against the span,
        its pixels read (`read(shape)`: the segment's float32 array of that shape), and the span's
        placeholder ids put back in `token_ids`. ValueError names what does not match."""
        ...


class Processor(ProcessingInfo, Protocol):
    """A family's processor: prompt text (or token ids) plus media -> a ProcessedPrompt."""

    def process(
        self,
        prompt: str | list[int],
        images: Sequence[ImageInput] = (),
        videos: Sequence[VideoInput] = (),
    ) -> ProcessedPrompt: ...

    def prompt_images(self, prompt: str | list[int]) -> tuple[str | list[int], list[str]]:
        """The images a prompt names itself, in order (a family whose prompts carry image paths
        inside their token ids; the server fetches them through its guard first; [] for the
        others), and the prompt to process next (token ids if finding them tokenized it, so
        that it is not tokenized twice). ValueError names a malformed span."""
        ...
