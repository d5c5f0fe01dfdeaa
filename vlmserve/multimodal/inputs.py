"""What the processor hands to the engine: token ids with placeholders expanded, one item per
image, and the M-RoPE positions. Plain data; the engine never sees PIL images or URLs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MultiModalItem:
    modality: str  # "image" or "video"
    # Placeholder tokens occupy prompt_token_ids[offset : offset + length].
    offset: int
    length: int
    grid_thw: tuple[int, int, int]
    content_hash: str
    pixel_values: torch.Tensor  # [t * h * w, patch_dim] float32, in patch order
    original_size: tuple[int, int]  # (width, height)
    resized_size: tuple[int, int]  # (width, height)
    # Videos: seconds covered by one temporal patch (temporal_patch_size / sampled fps); Qwen2.5-VL
    # spaces a video's temporal positions by it. None for images.
    second_per_grid_t: float | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]
    mm_items: list[MultiModalItem]
    # [3, len(prompt_token_ids)] int64 (t, h, w) positions; text tokens have all three equal.
    mrope_positions: torch.Tensor | None
    # Position of decode token i (0-based over the whole sequence) is i + mrope_delta.
    mrope_delta: int
    prompt: str | None = None
    # Mixed into the prefix-cache hash of the first block (vLLM's cache_salt): prompts with
    # different salts never share KV (here: their dynamic-NTK rotary bases differ).
    cache_salt: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)
