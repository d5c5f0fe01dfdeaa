"""Build a family's model on the target device and fill it from the checkpoint."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from vlmserve.attention import AttentionBackend
from vlmserve.config import ModelConfig
from vlmserve.kernels import select_linear_op
from vlmserve.model_files import count_weights, iterate_weights
from vlmserve.models.base import VLModel
from vlmserve.models.layers import bind_linear_op
from vlmserve.progress import progress

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    model_class: Callable[[ModelConfig, AttentionBackend], VLModel],
    config: ModelConfig,
    model_dir: Path,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
) -> VLModel:
    # Built on the meta device so no memory is spent on random initialisation, then allocated
    # once on the target device and filled from the checkpoint.
    with torch.device("meta"), _default_dtype(dtype):
        model = model_class(config, backend)
    model = model.to_empty(device=device)
    model.tie_weights()
    weights = progress(
        iterate_weights(model_dir), desc="loading weights", total=count_weights(model_dir), unit="tensor", logger=logger
    )
    with weights:
        model.load_weights(weights)
    bind_linear_op(model, select_linear_op(device, dtype))
    model.eval()
    model.requires_grad_(False)
    return model
