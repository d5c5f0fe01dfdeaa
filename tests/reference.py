"""Reference runs through transformers, on the same checkpoint files as vlmserve."""

from __future__ import annotations

import torch
from PIL import Image

IMAGE_PAD = "<|image_pad|>"
IMAGE_TOKEN_ID = 151655


def hf_prompt_ids(hf_tokenizer, hf_image_processor, text: str, images: list[Image.Image]) -> tuple[list[int], dict]:  # type: ignore[no-untyped-def]
    """Token ids and vision inputs as transformers' Qwen2VLProcessor makes them: each
    <|image_pad|> in the text replaced by grid.prod() // merge_size**2 copies, then tokenized.
    (The processor class itself needs torchvision for its video half; this is its image path.)"""
    vision: dict = {}
    if images:
        vision = dict(hf_image_processor(images, return_tensors="pt"))
        merge = hf_image_processor.merge_size**2
        parts = text.split(IMAGE_PAD)
        assert len(parts) == len(images) + 1
        counts = [int(g.prod()) // merge for g in vision["image_grid_thw"]]
        text = parts[0] + "".join("<|placeholder|>" * n + rest for n, rest in zip(counts, parts[1:], strict=True))
        text = text.replace("<|placeholder|>", IMAGE_PAD)
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids, vision


def hf_greedy(hf_model, prompt_ids: list[int], vision: dict, max_new_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """One request alone through transformers' generate, greedy."""
    ids = torch.tensor([prompt_ids])
    mm_token_type_ids = (ids == IMAGE_TOKEN_ID).int()
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=mm_token_type_ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **vision,
        )
    return out[0, ids.shape[1] :].tolist()


def hf_logits(hf_model, prompt_ids: list[int], vision: dict) -> torch.Tensor:  # type: ignore[no-untyped-def]
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model(input_ids=ids, mm_token_type_ids=(ids == IMAGE_TOKEN_ID).int(), **vision)
    return out.logits[0]


# -- videos and mixed prompts (Qwen2.5-VL) ------------------------------------------------------

VIDEO_PAD = "<|video_pad|>"
VIDEO_TOKEN_ID = 151656


def mm_token_type_ids(ids: torch.Tensor) -> torch.Tensor:
    """transformers' token types: 0 text, 1 image placeholder, 2 video placeholder."""
    return (ids == IMAGE_TOKEN_ID).int() + 2 * (ids == VIDEO_TOKEN_ID).int()


def video_patches(
    frames: torch.Tensor, patch_size: int = 14, merge_size: int = 2, temporal_patch_size: int = 2
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Frames [num_frames, channels, height, width] (already normalised) in the patch layout of
    transformers' Qwen2VLVideoProcessor.patchify: [grid_t * grid_h * grid_w, channels *
    temporal_patch_size * patch_size**2], each temporal patch made of consecutive frames, 2x2
    merge blocks contiguous. (The video processor itself needs torchvision.)"""
    num_frames, channels, height, width = frames.shape
    assert num_frames % temporal_patch_size == 0 and height % (patch_size * merge_size) == 0
    assert width % (patch_size * merge_size) == 0
    grid_t, grid_h, grid_w = num_frames // temporal_patch_size, height // patch_size, width // patch_size
    m = merge_size
    patches = frames.reshape(
        grid_t, temporal_patch_size, channels, grid_h // m, m, patch_size, grid_w // m, m, patch_size
    )
    # -> [grid_t, grid_h / m, grid_w / m, m, m, channels, temporal_patch_size, patch_size, patch_size]
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(grid_t * grid_h * grid_w, -1).contiguous(), (grid_t, grid_h, grid_w)


def hf_mm_logits(
    hf_model, prompt_ids: list[int], vision: dict, position_ids: torch.Tensor | None = None
) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Logits [num_tokens, vocab] of a prompt with images and/or videos. `vision` holds
    pixel_values / image_grid_thw and/or pixel_values_videos / video_grid_thw /
    second_per_grid_ts; `position_ids` [3, num_tokens] replaces transformers' own M-RoPE positions."""
    ids = torch.tensor([prompt_ids])
    extra = {} if position_ids is None else {"position_ids": position_ids[:, None, :]}
    with torch.no_grad():
        out = hf_model(input_ids=ids, mm_token_type_ids=mm_token_type_ids(ids), **vision, **extra)
    return out.logits[0]


def hf_mm_greedy(hf_model, prompt_ids: list[int], vision: dict, max_new_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """hf_greedy for prompts with images and/or videos."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=mm_token_type_ids(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **vision,
        )
    return out[0, ids.shape[1] :].tolist()


def hf_mm_prompt_ids(  # type: ignore[no-untyped-def]
    hf_tokenizer, hf_image_processor, text: str, media: list, merge_size: int = 2
) -> tuple[list[int], dict]:
    """hf_prompt_ids for prompts holding <|image_pad|> and <|video_pad|>: `media` lists, in prompt
    order, PIL images and (video pixel_values, grid_thw, second_per_grid_t) triples (see
    video_patches); videos go to transformers exactly as given."""
    import re

    images = [m for m in media if isinstance(m, Image.Image)]
    videos = [m for m in media if not isinstance(m, Image.Image)]
    vision: dict = dict(hf_image_processor(images, return_tensors="pt")) if images else {}
    if videos:
        vision["pixel_values_videos"] = torch.cat([pixels for pixels, _, _ in videos])
        vision["video_grid_thw"] = torch.tensor([grid for _, grid, _ in videos])
        vision["second_per_grid_ts"] = torch.tensor([seconds for _, _, seconds in videos])
    image_counts = iter(int(g.prod()) // merge_size**2 for g in vision.get("image_grid_thw", []))
    video_counts = iter(t * h * w // merge_size**2 for _, (t, h, w), _ in videos)
    parts = re.split(f"({re.escape(IMAGE_PAD)}|{re.escape(VIDEO_PAD)})", text)
    counts = {IMAGE_PAD: image_counts, VIDEO_PAD: video_counts}
    expanded = "".join(part * next(counts[part]) if part in counts else part for part in parts)
    ids = hf_tokenizer(expanded, add_special_tokens=False)["input_ids"]
    return ids, vision
