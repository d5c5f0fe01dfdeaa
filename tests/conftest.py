"""Shared fixtures: tiny checkpoints written once per session, and transformers' reference
implementation loaded on the same files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlmserve.tools.tiny_checkpoint import TinySpec, write_tiny_qwen2_vl

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings, transformers 4.x flat config, one safetensors file, template in
    tokenizer_config.json: the Qwen2-VL-2B-Instruct layout."""
    return write_tiny_qwen2_vl(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2-vl")


@pytest.fixture(scope="session")
def tiny_untied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied lm_head, transformers 5 nested config, two shards with an index, template in
    chat_template.jinja."""
    return write_tiny_qwen2_vl(
        tmp_path_factory.mktemp("ckpt") / "tiny-qwen2-vl-untied",
        TinySpec(tie_word_embeddings=False),
        seed=1,
        nested_config=True,
        num_shards=2,
        chat_template_in="chat_template.jinja",
    )


@pytest.fixture(scope="session")
def hf_model(tiny_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_image_processor(tiny_dir: Path):  # type: ignore[no-untyped-def]
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """Smooth random content (noise plus gradients), so resizing has structure to preserve."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1), (x + y) * 127 / max(width + height, 1)], -1)
    pixels = np.clip(base + rng.normal(0, 40, (height, width, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    return image if mode == "RGB" else image.convert(mode)


@pytest.fixture(scope="session")
def images() -> dict[str, Image.Image]:
    return {
        "wide": random_image(150, 100, seed=1),
        "tall": random_image(70, 190, seed=2),
        "small": random_image(40, 30, seed=3),
        "odd": random_image(123, 77, seed=4),
    }
