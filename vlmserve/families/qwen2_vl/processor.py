"""The Qwen2-VL processor: prompt text or token ids plus images and videos become a
ProcessedPrompt with every <|image_pad|> and <|video_pad|> expanded to t*h*w / merge_size**2
tokens, one MultiModalItem per image or video in prompt order, and the M-RoPE positions."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np
import torch
from PIL import Image

from vlmserve.config import ModelConfig
from vlmserve.multimodal import handles
from vlmserve.multimodal.image import ImageProcessorConfig, ProcessedImage, process_image, target_size
from vlmserve.multimodal.inputs import MultiModalItem, ProcessedPrompt
from vlmserve.multimodal.media import DEFAULT_LIMITS, MediaError, MediaLimits, load_pixels, open_lazily, oriented_size
from vlmserve.multimodal.mrope import mrope_positions
from vlmserve.multimodal.video import (
    MODEL_SEQ_LEN,
    VIDEO_MAX_TOKENS,
    ProcessedVideo,
    VideoPlan,
    open_video,
    process_video,
)
from vlmserve.processor.base import ImageInput, ProcessorLimits, VideoInput
from vlmserve.tokenizer import Tokenizer


class Qwen2VLProcessingInfo:
    """What the engine needs of the processor, without a tokenizer (the engine process loads
    none): the admitted limits, worst-case dummy inputs for memory planning (vLLM's way), and a
    prompt rebuilt from token ids and items processed elsewhere."""

    def __init__(
        self,
        config: ModelConfig,
        image_config: ImageProcessorConfig,
        limits: ProcessorLimits,
        media_limits: MediaLimits = DEFAULT_LIMITS,
    ) -> None:
        self.config = config
        self.image_config = image_config
        self.limits = limits
        self.media_limits = media_limits
        self.merge_size = config.vision.spatial_merge_size
        if image_config.merge_size != self.merge_size or image_config.patch_size != config.vision.patch_size:
            raise ValueError("preprocessor_config.json and config.json disagree on patch_size or merge_size")

    # -- what the memory planner needs (vLLM's processing info and dummy inputs) -----------

    def max_items_per_prompt(self) -> dict[str, int]:
        return {"image": self.limits.limit("image"), "video": self.limits.limit("video")}

    def max_tokens_per_item(self) -> dict[str, int]:
        """Placeholder tokens of the largest image and video admitted, at most a prompt's worth
        each: an image as large as max_pixels (and media_limits.max_image_tokens) allows; a video
        as long as qwen-vl-utils' default total_pixels allows (128000 * 0.9 tokens, and
        media_limits.max_video_tokens), of frames no larger than max_video_frame_tokens."""
        cfg = self.image_config
        by_pixels = cfg.max_pixels // (cfg.patch_size**2 * self.merge_size**2)
        prompt = self.limits.max_model_len - 1
        image = min(by_pixels, prompt)
        if self.media_limits.max_image_tokens is not None:
            image = min(image, self.media_limits.max_image_tokens)
        video = min(int(MODEL_SEQ_LEN * 0.9), prompt)
        if self.media_limits.max_video_tokens is not None:
            video = min(video, self.media_limits.max_video_tokens)
        return {"image": max(1, image), "video": max(1, video)}

    def max_video_frame_tokens(self) -> int:
        """Tokens one temporal patch of a video may take: qwen-vl-utils' largest default frame
        (768 tokens) or the largest image, whichever is more. Bounds the vision encoder's
        attention segments, which are one temporal patch each."""
        return min(max(VIDEO_MAX_TOKENS, self.max_tokens_per_item()["image"]), self.max_tokens_per_item()["video"])

    def dummy_items(self, count: int, tokens_per_item: int, modality: str = "image") -> list[MultiModalItem]:
        """`count` items of the most placeholder tokens up to `tokens_per_item`, with random
        patches: worst-case encoder inputs for profiling. A video's temporal patches are frames
        of max_video_frame_tokens() at most (its attention segments), as many as fit."""
        per_frame = tokens_per_item if modality == "image" else min(tokens_per_item, self.max_video_frame_tokens())
        # The merged grid (a x b) with the most cells a * b <= per_frame, aspect <= 200.
        best = max(
            ((a, per_frame // a) for a in range(1, int(per_frame**0.5) + 1)),
            key=lambda ab: (ab[0] * ab[1], ab[0]) if ab[1] <= 200 * ab[0] else (0, 0),
        )
        t = 1 if modality == "image" else max(1, tokens_per_item // (best[0] * best[1]))
        m, p = self.merge_size, self.image_config.patch_size
        grid = (t, best[0] * m, best[1] * m)
        patch_dim = self.config.vision.patch_dim
        return [
            MultiModalItem(
                modality=modality,
                offset=0,
                length=t * best[0] * best[1],
                grid_thw=grid,
                content_hash=f"dummy-{modality}-{k}",
                pixel_values=torch.randn(t * grid[1] * grid[2], patch_dim),
                original_size=(grid[2] * p, grid[1] * p),
                resized_size=(grid[2] * p, grid[1] * p),
                second_per_grid_t=None if modality == "image" else 1.0,
            )
            for k in range(count)
        ]

    def from_token_ids(self, token_ids: list[int], items: list[MultiModalItem]) -> ProcessedPrompt:
        """A prompt whose items were processed elsewhere (the API process, a token-handle prompt):
        each item's span checked against its placeholder token, positions rebuilt."""
        vocab = self.config.text.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
        placeholder = {"image": self.config.image_token_id, "video": self.config.video_token_id}
        for item in items:
            token = placeholder.get(item.modality)
            if token is None:
                raise ValueError(f"unknown modality {item.modality!r}")
            if item.end > len(token_ids) or any(t != token for t in token_ids[item.offset : item.end]):
                raise ValueError(f"{item.modality} placeholders at {item.offset}..{item.end} do not match the prompt")
        positions, delta = mrope_positions(len(token_ids), items, self.merge_size, self.config.vision.tokens_per_second)
        return ProcessedPrompt(token_ids, items, positions, delta)

    # -- the list-of-dicts input: items as shared-memory handles in the token ids -----------------------------
    #
    #     ids   ... <|vision_start|> HANDLE GRID [SECONDS] <|image_pad|> ... <|vision_end|>
    #     index     p - 1            p      p+1  p+2       ...                p + length
    #
    # at each item's first placeholder p: the segment's handle, its grid (t, h, w) tagged image
    # or video, and for a video the seconds one temporal patch spans (float32, what M-RoPE takes);
    # the segment holds the item's pixel patches [t * h * w, patch_dim]. A Qwen3-VL video is one
    # item per timestamped span, so each span carries its own.

    def handle_payload(self, item: MultiModalItem) -> tuple[np.ndarray, list[int]]:
        values = [handles.grid_to_int64(item.grid_thw, item.modality)]
        if item.modality == "video":
            assert item.second_per_grid_t is not None
            values.append(handles.seconds_to_int64(item.second_per_grid_t))
        return item.pixel_values.numpy(), values

    def handle_positions(self, token_ids: Sequence[int]) -> list[int]:
        return handles.handles_after(self.config.vision_start_token_id, token_ids)

    def item_from_handle(
        self, token_ids: list[int], position: int, read: Callable[[tuple[int, ...]], np.ndarray]
    ) -> MultiModalItem:
        p = position
        if p + 1 >= len(token_ids):
            raise ValueError(f"the segment handle at token {p} is not followed by a grid")
        modality, (t, h, w) = handles.int64_to_grid(token_ids[p + 1])
        length = t * h * w // self.merge_size**2
        used = 2 if modality == "image" else 3  # the handle, the grid, a video's seconds
        end = p + length
        if h % self.merge_size or w % self.merge_size or length < used:
            raise ValueError(f"{modality} grid ({t}, {h}, {w}) at token {p + 1} cannot carry a segment handle")
        if end >= len(token_ids) or token_ids[end] != self.config.vision_end_token_id:
            raise ValueError(f"{modality} grid ({t}, {h}, {w}) does not match the placeholder run at token {p}")
        seconds = handles.int64_to_seconds(token_ids[p + 2]) if modality == "video" else None
        placeholder = self.config.image_token_id if modality == "image" else self.config.video_token_id
        if any(tok != placeholder for tok in token_ids[p + used : end]):
            raise ValueError(f"the {modality} placeholder run at token {p} holds other tokens")
        pixels = read((t * h * w, self.config.vision.patch_dim))
        token_ids[p:end] = [placeholder] * length
        size = (w * self.config.vision.patch_size, h * self.config.vision.patch_size)
        return MultiModalItem(
            modality=modality,
            offset=p,
            length=length,
            grid_thw=(t, h, w),
            content_hash=hashlib.blake2b(pixels.tobytes(), digest_size=16).hexdigest(),
            pixel_values=torch.from_numpy(np.ascontiguousarray(pixels)),
            original_size=size,
            resized_size=size,
            second_per_grid_t=seconds,
        )


class Qwen2VLProcessor(Qwen2VLProcessingInfo):
    """Prompt text or token ids plus images and videos -> a ProcessedPrompt (module docstring)."""

    def __init__(
        self,
        config: ModelConfig,
        tokenizer: Tokenizer,
        image_config: ImageProcessorConfig,
        limits: ProcessorLimits,
        media_limits: MediaLimits = DEFAULT_LIMITS,
    ) -> None:
        super().__init__(config, image_config, limits, media_limits)
        self.tokenizer = tokenizer

    def prompt_images(self, prompt: str | list[int]) -> tuple[str | list[int], list[str]]:
        """Qwen2-VL prompts name no images inside their token ids."""
        return prompt, []

    def process(
        self, prompt: str | list[int], images: Sequence[ImageInput] = (), videos: Sequence[VideoInput] = ()
    ) -> ProcessedPrompt:
        """`prompt` holds one <|image_pad|> per image and one <|video_pad|> per video, in any order
        (each inside <|vision_start|>...<|vision_end|>, as the chat template writes it); each is
        expanded to its item's token count."""
        text = prompt if isinstance(prompt, str) else None
        token_ids = self._token_ids(prompt, images, videos)
        image_id, video_id = self.config.image_token_id, self.config.video_token_id
        # Token counts come from the target sizes and the chosen frames alone (an image's header is
        # read, its pixels not decoded; a video is demuxed, not decoded): check them and the length
        # before the pixel work, so a small file declaring a huge image costs no decoding.
        opened, image_counts = self._open_images(images)
        plans = [open_video(v.source, v.options, self.image_config, v.label, self.media_limits) for v in videos]
        video_counts = [self._video_tokens(plan) for plan in plans]
        # NOTE: this is the request's multimodal budget too: the items of one prompt can never need
        # more than max_model_len - 1 - its text, so no separate per-request total is kept.
        num_text = len(token_ids) - len(images) - len(videos)
        num_tokens = num_text + sum(image_counts) + sum(video_counts)
        if num_tokens >= self.limits.max_model_len:
            video_part = f" + {sum(video_counts)} video" if videos else ""
            counts: list[tuple[ImageInput | VideoInput, int]] = [
                *zip(images, image_counts, strict=True),
                *zip(videos, video_counts, strict=True),
            ]
            per_item = ", ".join(f"{item.label}: {count}" for item, count in counts)
            raise ValueError(
                f"prompt needs {num_tokens} tokens ({num_text} text + {sum(image_counts)} image{video_part}), "
                f"which leaves no room to generate within max_model_len={self.limits.max_model_len}"
                + (
                    f"; tokens per item: {per_item}. Send fewer or smaller items (max_pixels, "
                    "resized_height/resized_width; a video's fps, nframes or total_pixels)"
                    if counts
                    else ""
                )
            )

        expanded: list[int] = []
        items: list[MultiModalItem] = []
        next_image = iter(zip(opened, images, image_counts, strict=True))
        next_video = iter(zip(plans, video_counts, strict=True))
        for token in token_ids:
            if token == image_id:
                pil, image, count = next(next_image)
                item = self._item("image", self._decode_and_process(pil, image), count, len(expanded))
            elif token == video_id:
                plan, count = next(next_video)
                processed = process_video(plan, self.image_config, self.media_limits)
                item = self._item("video", processed, count, len(expanded))
            else:
                expanded.append(token)
                continue
            items.append(item)
            expanded.extend([token] * item.length)
        positions, delta = mrope_positions(len(expanded), items, self.merge_size, self.config.vision.tokens_per_second)
        return ProcessedPrompt(
            prompt_token_ids=expanded, mm_items=items, mrope_positions=positions, mrope_delta=delta, prompt=text
        )

    def _token_ids(
        self, prompt: str | list[int], images: Sequence[ImageInput], videos: Sequence[VideoInput]
    ) -> list[int]:
        """The prompt's token ids, checked: not empty, in the vocabulary, one placeholder per image
        and per video (within the limits)."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.config.text.vocab_size
        bad = next((i for i, t in enumerate(token_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1}; position {bad} holds {token_ids[bad]}")
        image_id, video_id = self.config.image_token_id, self.config.video_token_id
        self._check_count("image", "<|image_pad|>", images, token_ids.count(image_id))
        self._check_count("video", "<|video_pad|>", videos, token_ids.count(video_id))
        return token_ids

    def _open_images(self, images: Sequence[ImageInput]) -> tuple[list[Image.Image], list[int]]:
        """Each image opened (its header read, its pixels not yet decoded) and its token count."""
        opened = [
            image.source
            if isinstance(image.source, Image.Image)
            else open_lazily(image.source, image.label, self.media_limits)
            for image in images
        ]
        return opened, [self._image_tokens(image, pil) for image, pil in zip(images, opened, strict=True)]

    def _check_count(
        self, modality: str, pad: str, inputs: Sequence[ImageInput] | Sequence[VideoInput], num_pads: int
    ) -> None:
        limit = self.limits.limit(modality)
        if len(inputs) > limit:
            raise ValueError(
                f"too many {modality}s: {len(inputs)} given, at most {limit} per prompt "
                f"(the first one over: {inputs[limit].label})"
            )
        if num_pads != len(inputs):
            unplaced = f" ({inputs[num_pads].label} has none)" if len(inputs) > num_pads else ""
            raise ValueError(
                f"the prompt holds {num_pads} {pad} placeholder(s) but {len(inputs)} {modality}(s) were given"
                f"{unplaced}; write <|vision_start|>{pad}<|vision_end|> once per {modality}"
            )

    def _image_tokens(self, image: ImageInput, pil: Image.Image) -> int:
        """The image's token count from its header (a PIL image passed in: its size as it is)."""
        width, height = pil.size if isinstance(image.source, Image.Image) else oriented_size(pil)
        try:
            h, w = target_size(width, height, self.image_config, image.sizing)
        except ValueError as e:
            raise MediaError(f"{image.label}: {e}") from None
        count = (h // self.image_config.patch_size) * (w // self.image_config.patch_size) // self.merge_size**2
        max_per_image = self.max_tokens_per_item()["image"]
        if count > max_per_image:
            raise MediaError(
                f"{image.label}: the image needs {count} tokens, at most {max_per_image} per image are admitted "
                f"(max_pixels={self.image_config.max_pixels}, max_model_len={self.limits.max_model_len}"
                + (
                    f", max_image_tokens={self.media_limits.max_image_tokens})"
                    if self.media_limits.max_image_tokens is not None
                    else ")"
                )
            )
        return count

    def _decode_and_process(self, pil: Image.Image, image: ImageInput) -> ProcessedImage:
        """One image's pixels, decoded (a PIL image passed in: as it is) and released once
        processed, so that a request holds one decoded image at a time."""
        if isinstance(image.source, Image.Image):
            return process_image(pil, self.image_config, image.sizing)
        try:
            return process_image(load_pixels(pil, image.label), self.image_config, image.sizing)
        finally:
            pil.close()

    def _video_tokens(self, plan: VideoPlan) -> int:
        t, h, w = plan.grid_thw
        per_frame = h * w // self.merge_size**2
        max_per_frame = self.max_video_frame_tokens()
        if per_frame > max_per_frame:
            width, height = plan.resized_size
            raise MediaError(
                f"{plan.label}: frames of {width}x{height} need {per_frame} tokens each, at most {max_per_frame} are "
                "admitted; lower max_pixels, min_pixels or resized_height/resized_width"
            )
        max_per_video = self.max_tokens_per_item()["video"]
        if t * per_frame > max_per_video:
            raise MediaError(
                f"{plan.label}: the video needs {t * per_frame} tokens ({t} temporal patches of {per_frame}), at most "
                f"{max_per_video} per video are admitted (max_model_len={self.limits.max_model_len}"
                + (
                    f", max_video_tokens={self.media_limits.max_video_tokens}"
                    if self.media_limits.max_video_tokens is not None
                    else ""
                )
                + "); lower fps, nframes, max_frames, max_pixels or total_pixels"
            )
        return t * per_frame

    def _item(
        self, modality: str, processed: ProcessedImage | ProcessedVideo, count: int, offset: int
    ) -> MultiModalItem:
        assert processed.pixel_values.shape[0] // self.merge_size**2 == count
        return MultiModalItem(
            modality=modality,
            offset=offset,
            length=count,
            grid_thw=processed.grid_thw,
            content_hash=processed.content_hash,
            pixel_values=torch.from_numpy(processed.pixel_values),
            original_size=processed.original_size,
            resized_size=processed.resized_size,
            second_per_grid_t=processed.second_per_grid_t if isinstance(processed, ProcessedVideo) else None,
        )
