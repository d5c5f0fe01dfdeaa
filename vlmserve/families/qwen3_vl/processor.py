"""The Qwen3-VL processor: Qwen2-VL's image path (16-pixel patches, merge 2: multiples of 32
pixels; the published min/max pixels come from preprocessor_config.json's size), and videos as
transformers' Qwen3VLProcessor writes them: one span per temporal patch after its timestamp,
each span its own item (video.py). M-RoPE positions are Qwen2-VL's rule over those items: each
span's frames share the temporal position of its start, text resumes one past the span."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vlmserve.config import ModelConfig
from vlmserve.families.qwen2_vl.processor import Qwen2VLProcessingInfo, Qwen2VLProcessor
from vlmserve.families.qwen3_vl.video import patch_timestamps, plan_video, timestamp_text
from vlmserve.multimodal.image import ImageProcessorConfig
from vlmserve.multimodal.inputs import MultiModalItem, ProcessedPrompt
from vlmserve.multimodal.media import DEFAULT_LIMITS, MediaLimits
from vlmserve.multimodal.mrope import mrope_positions
from vlmserve.multimodal.video import VideoPlan, process_video
from vlmserve.processor.base import ImageInput, ProcessorLimits, VideoInput
from vlmserve.tokenizer import Tokenizer


class Qwen3VLProcessingInfo(Qwen2VLProcessingInfo):
    """Qwen2-VL's: a Qwen3-VL prompt's items (images, and the spans of a video) are contiguous
    runs of their placeholder token, and positions follow from them the same way."""


class Qwen3VLProcessor(Qwen2VLProcessor):
    def __init__(
        self,
        config: ModelConfig,
        tokenizer: Tokenizer,
        image_config: ImageProcessorConfig,
        limits: ProcessorLimits,
        media_limits: MediaLimits = DEFAULT_LIMITS,
        video_config: ImageProcessorConfig | None = None,
    ) -> None:
        super().__init__(config, tokenizer, image_config, limits, media_limits)
        # video_preprocessor_config.json: its size bounds a whole clip (frames x height x width).
        self.video_config = video_config or image_config
        if (self.video_config.patch_size, self.video_config.merge_size) != (image_config.patch_size, self.merge_size):
            raise ValueError("video_preprocessor_config.json and preprocessor_config.json disagree on patch or merge")

    def process(
        self, prompt: str | list[int], images: Sequence[ImageInput] = (), videos: Sequence[VideoInput] = ()
    ) -> ProcessedPrompt:
        """`prompt` holds one <|image_pad|> per image and one <|video_pad|> per video (as the chat
        template writes them); an image's is repeated for its tokens, a video's becomes its
        timestamped spans."""
        text = prompt if isinstance(prompt, str) else None
        token_ids = self._token_ids(prompt, images, videos)
        image_id, video_id = self.config.image_token_id, self.config.video_token_id
        # Token counts first (image headers, video indexes), the pixel work after the length check.
        opened, image_counts = self._open_images(images)
        plans = [plan_video(v.source, v.options, self.video_config, v.label, self.media_limits) for v in videos]
        spans = [self._video_spans(plan, fps) for plan, fps in plans]
        num_text = len(token_ids) - len(images) - len(videos)
        video_tokens = sum(len(ids) for span in spans for ids in span)
        num_tokens = num_text + sum(image_counts) + video_tokens
        if num_tokens >= self.limits.max_model_len:
            video_part = f" + {video_tokens} video" if videos else ""
            raise ValueError(
                f"prompt needs {num_tokens} tokens ({num_text} text + {sum(image_counts)} image{video_part}), "
                f"which leaves no room to generate within max_model_len={self.limits.max_model_len}"
            )

        expanded: list[int] = []
        items: list[MultiModalItem] = []
        next_image = iter(zip(opened, images, image_counts, strict=True))
        next_video = iter(zip(plans, spans, strict=True))
        for token in token_ids:
            if token == image_id:
                pil, image, count = next(next_image)
                item = self._item("image", self._decode_and_process(pil, image), count, len(expanded))
                items.append(item)
                expanded.extend([token] * item.length)
            elif token == video_id:
                (plan, _), video_spans = next(next_video)
                items.extend(self._video_items(plan, video_spans, expanded))
            else:
                expanded.append(token)
        positions, delta = mrope_positions(len(expanded), items, self.merge_size)
        return ProcessedPrompt(
            prompt_token_ids=expanded, mm_items=items, mrope_positions=positions, mrope_delta=delta, prompt=text
        )

    def _video_spans(self, plan: VideoPlan, video_fps: float) -> list[list[int]]:
        """Token ids of each temporal patch's span: its timestamp, <|vision_start|>, placeholders,
        <|vision_end|>. Checks the video's token counts against the limits."""
        self._video_tokens(plan)
        t, h, w = plan.grid_thw
        per_frame = h * w // self.merge_size**2
        times = patch_timestamps(plan.frame_indices, video_fps, self.video_config.temporal_patch_size)
        assert len(times) == t
        start, end = self.config.vision_start_token_id, self.config.vision_end_token_id
        return [
            [*self.tokenizer.encode(timestamp_text(s)), start, *[self.config.video_token_id] * per_frame, end]
            for s in times
        ]

    def _video_items(self, plan: VideoPlan, spans: list[list[int]], expanded: list[int]) -> list[MultiModalItem]:
        """Append the video's spans to `expanded`; one item per span (its rows of the pixels)."""
        processed = process_video(plan, self.video_config, self.media_limits)
        pixels = torch.from_numpy(processed.pixel_values)
        _, h, w = processed.grid_thw
        items = []
        for k, span in enumerate(spans):
            length = h * w // self.merge_size**2
            head = len(span) - length - 1  # the timestamp and <|vision_start|>
            items.append(
                MultiModalItem(
                    modality="video",
                    offset=len(expanded) + head,
                    length=length,
                    grid_thw=(1, h, w),
                    content_hash=f"{processed.content_hash}-{k}",
                    pixel_values=pixels[k * h * w : (k + 1) * h * w],
                    original_size=processed.original_size,
                    resized_size=processed.resized_size,
                    second_per_grid_t=processed.second_per_grid_t,
                )
            )
            expanded.extend(span)
        return items
