"""The Qwen2-VL processor (seed 001): prompt text or token ids plus images become a
ProcessedPrompt with every <|image_pad|> expanded to t*h*w / merge_size**2 tokens, one
MultiModalItem per image, and the M-RoPE positions."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlmserve.config import ModelConfig
from vlmserve.multimodal.image import ImageProcessorConfig, ImageSizing, process_image, target_size
from vlmserve.multimodal.inputs import MultiModalItem, ProcessedPrompt
from vlmserve.multimodal.media import DEFAULT_LIMITS, MediaError, MediaLimits, load_image
from vlmserve.multimodal.mrope import mrope_positions
from vlmserve.tokenizer import Tokenizer


@dataclass(frozen=True)
class ImageInput:
    """One image as the user gave it: a path, URL, bytes or PIL image, and its resize options."""

    source: object
    sizing: ImageSizing = field(default_factory=ImageSizing)
    label: str = "image"


@dataclass(frozen=True)
class ProcessorLimits:
    max_model_len: int
    # Items of each modality one prompt may hold (vLLM's limit_mm_per_prompt).
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 8})


class Qwen2VLProcessor:
    def __init__(
        self,
        config: ModelConfig,
        tokenizer: Tokenizer,
        image_config: ImageProcessorConfig,
        limits: ProcessorLimits,
        media_limits: MediaLimits = DEFAULT_LIMITS,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.image_config = image_config
        self.limits = limits
        self.media_limits = media_limits
        self.merge_size = config.vision.spatial_merge_size
        if image_config.merge_size != self.merge_size or image_config.patch_size != config.vision.patch_size:
            raise ValueError("preprocessor_config.json and config.json disagree on patch_size or merge_size")

    # -- what the memory planner needs (seed 003's processing info and dummy inputs) -----------

    def max_items_per_prompt(self) -> dict[str, int]:
        return {"image": self.limits.limit_mm_per_prompt.get("image", 0)}

    def max_tokens_per_item(self) -> dict[str, int]:
        """Placeholder tokens of the largest image admitted: what max_pixels allows, and at
        most a prompt's worth."""
        cfg = self.image_config
        by_pixels = cfg.max_pixels // (cfg.patch_size**2 * self.merge_size**2)
        return {"image": max(1, min(by_pixels, self.limits.max_model_len - 1))}

    def dummy_items(self, count: int, tokens_per_item: int) -> list[MultiModalItem]:
        """`count` images of the most placeholder tokens up to `tokens_per_item`, with random
        patches: worst-case encoder inputs for profiling."""
        # The merged grid (a x b) with the most cells a * b <= tokens_per_item, aspect <= 200.
        best = max(
            ((a, tokens_per_item // a) for a in range(1, int(tokens_per_item**0.5) + 1)),
            key=lambda ab: (ab[0] * ab[1], ab[0]) if ab[1] <= 200 * ab[0] else (0, 0),
        )
        m = self.merge_size
        grid = (1, best[0] * m, best[1] * m)
        patch_dim = self.config.vision.patch_dim
        return [
            MultiModalItem(
                modality="image",
                offset=0,
                length=best[0] * best[1],
                grid_thw=grid,
                content_hash=f"dummy-{k}",
                pixel_values=torch.randn(grid[1] * grid[2], patch_dim),
                original_size=(grid[2] * self.image_config.patch_size, grid[1] * self.image_config.patch_size),
                resized_size=(grid[2] * self.image_config.patch_size, grid[1] * self.image_config.patch_size),
            )
            for k in range(count)
        ]

    def process(self, prompt: str | list[int], images: list[ImageInput]) -> ProcessedPrompt:
        """`prompt` holds one <|image_pad|> per image (inside <|vision_start|>...<|vision_end|>,
        as the chat template writes it); each is expanded to the image's token count."""
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.config.text.vocab_size
        bad = next((i for i, t in enumerate(token_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1}; position {bad} holds {token_ids[bad]}")
        image_id = self.config.image_token_id
        if self.config.video_token_id in token_ids:
            raise ValueError("video input is not supported yet; the prompt holds <|video_pad|>")
        max_images = self.limits.limit_mm_per_prompt.get("image", 0)
        if len(images) > max_images:
            raise ValueError(f"too many images: {len(images)} given, at most {max_images} per prompt")
        num_pads = token_ids.count(image_id)
        if num_pads != len(images):
            raise ValueError(
                f"the prompt holds {num_pads} <|image_pad|> placeholder(s) but {len(images)} image(s) were given; "
                "write <|vision_start|><|image_pad|><|vision_end|> once per image"
            )

        pil_images = [load_image(image.source, image.label, self.media_limits) for image in images]
        # Token counts come from the target sizes alone: check the length before the pixel work.
        counts = []
        for image, pil in zip(images, pil_images, strict=True):
            try:
                h, w = target_size(pil.width, pil.height, self.image_config, image.sizing)
            except ValueError as e:
                raise MediaError(f"{image.label}: {e}") from None
            counts.append(
                (h // self.image_config.patch_size) * (w // self.image_config.patch_size) // self.merge_size**2
            )
        max_per_image = self.max_tokens_per_item()["image"]
        for image, count in zip(images, counts, strict=True):
            if count > max_per_image:
                raise MediaError(
                    f"{image.label}: the image needs {count} tokens, at most {max_per_image} per image are admitted "
                    f"(max_pixels={self.image_config.max_pixels}, max_model_len={self.limits.max_model_len})"
                )
        num_tokens = len(token_ids) - num_pads + sum(counts)
        if num_tokens >= self.limits.max_model_len:
            raise ValueError(
                f"prompt needs {num_tokens} tokens ({len(token_ids) - num_pads} text + {sum(counts)} image), "
                f"which leaves no room to generate within max_model_len={self.limits.max_model_len}"
            )

        expanded: list[int] = []
        items: list[MultiModalItem] = []
        k = 0
        for token in token_ids:
            if token != image_id:
                expanded.append(token)
                continue
            processed = process_image(pil_images[k], self.image_config, images[k].sizing)
            assert processed.pixel_values.shape[0] // self.merge_size**2 == counts[k]
            items.append(
                MultiModalItem(
                    modality="image",
                    offset=len(expanded),
                    length=counts[k],
                    grid_thw=processed.grid_thw,
                    content_hash=processed.content_hash,
                    pixel_values=torch.from_numpy(processed.pixel_values),
                    original_size=processed.original_size,
                    resized_size=processed.resized_size,
                )
            )
            expanded.extend([image_id] * counts[k])
            k += 1
        positions, delta = mrope_positions(len(expanded), items, self.merge_size, self.config.vision.tokens_per_second)
        return ProcessedPrompt(
            prompt_token_ids=expanded, mm_items=items, mrope_positions=positions, mrope_delta=delta, prompt=text
        )
