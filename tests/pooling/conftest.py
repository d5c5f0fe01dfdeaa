"""Tiny Qwen3-VL-Embedding and Qwen3-VL-Reranker checkpoints (make-tiny's embedding and reranker
presets) and transformers' model, tokenizer and image processor over them, once a module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from vlmserve.registry import BY_NAME


@pytest.fixture(scope="session")
def embedding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return BY_NAME["qwen3_vl"].write_tiny(
        tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-vl-embedding", preset="embedding"
    )


@pytest.fixture(scope="session")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return BY_NAME["qwen3_vl"].write_tiny(
        tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-vl-reranker", preset="reranker", seed=1
    )


def hf_model(model_dir: Path) -> Any:
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_image_processor(model_dir: Path) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
