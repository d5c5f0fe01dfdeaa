"""The Qwen3-VL processor: Qwen2-VL's image path at 16-pixel patches (factor 32), and videos as
transformers' Qwen3VLProcessor writes them (see video.py)."""

from __future__ import annotations

from vlmserve.config import ModelConfig
from vlmserve.families.qwen2_vl.processor import Qwen2VLProcessingInfo, Qwen2VLProcessor
from vlmserve.multimodal.image import ImageProcessorConfig
from vlmserve.multimodal.media import DEFAULT_LIMITS, MediaLimits
from vlmserve.processor.base import ProcessorLimits
from vlmserve.tokenizer import Tokenizer


class Qwen3VLProcessingInfo(Qwen2VLProcessingInfo):
    pass


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
        self.video_config = video_config or image_config
