"""Model families behind one protocol: embed_multimodal, get_input_embeddings, forward,
compute_logits, load_weights. The engine never branches on the family."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from vlmserve.attention import AttentionBackend
from vlmserve.config import ModelConfig
from vlmserve.kernels import select_linear_op
from vlmserve.model_files import iterate_weights
from vlmserve.models.base import VLModel
from vlmserve.models.layers import bind_linear_op
from vlmserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from vlmserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
from vlmserve.models.qwen_vl import QWenLMHeadModel

MODEL_REGISTRY: dict[str, type[VLModel]] = {
    "QWenLMHeadModel": QWenLMHeadModel,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config: ModelConfig, model_dir: Path, backend: AttentionBackend, device: torch.device, dtype: torch.dtype
) -> VLModel:
    if config.architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {config.architecture!r}; supported: {sorted(MODEL_REGISTRY)}")
    # Built on the meta device so no memory is spent on random initialisation, then allocated
    # once on the target device and filled from the checkpoint.
    with torch.device("meta"), _default_dtype(dtype):
        model = MODEL_REGISTRY[config.architecture](config, backend)  # type: ignore[call-arg]
    model = model.to_empty(device=device)
    model.tie_weights()
    model.load_weights(iterate_weights(model_dir))
    bind_linear_op(model, select_linear_op(device, dtype))
    model.eval()
    model.requires_grad_(False)
    return model
