"""transformers' model and image processor over the tiny Qwen3-VL-Embedding and Qwen3-VL-Reranker
checkpoints (the session fixtures embedding_dir and reranker_dir of tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def hf_model(model_dir: Path) -> Any:
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_image_processor(model_dir: Path) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
