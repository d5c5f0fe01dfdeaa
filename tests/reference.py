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
