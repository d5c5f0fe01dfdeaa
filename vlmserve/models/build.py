"""Build a family's model on the target device and fill it from the checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from vlmserve.attention import AttentionBackend
from vlmserve.config import ModelConfig
from vlmserve.kernels import select_linear_op
from vlmserve.kernels.onednn import PACKED_ROWS, packed_linear
from vlmserve.model_files import count_weights, iterate_weights, weight_names
from vlmserve.models.base import VLModel
from vlmserve.models.fused_decode import FUSED_ROWS
from vlmserve.models.huge_pages import move_to_huge_pages
from vlmserve.models.layers import bind_linear_op, linear_shapes
from vlmserve.models.prepack import packable_decoder_layers, prepack_linear_layers, prepacks_vision
from vlmserve.models.quant import read_packed_config, resolve_quantization
from vlmserve.models.quant.packed import PackedConfig, dequantize_weights
from vlmserve.progress import progress, waiting

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _naming_checkpoint(model_dir: Path) -> Iterator[None]:
    """A checkpoint refused while the model is built or loaded: its folder named in the error."""
    try:
        yield
    except ValueError as error:
        raise ValueError(f"checkpoint {model_dir}: {error}") from error


def _keep_packed(model: VLModel, model_dir: Path, packed: PackedConfig, device: torch.device) -> frozenset[str]:
    """Which checkpoint modules load 4-bit (their Linear layers replaced by Int4Linear), where the
    int4 kernels apply; none elsewhere (the checkpoint is dequantized as it loads)."""
    from vlmserve.distributed import tp_size
    from vlmserve.kernels.int4 import load_int4_kernel
    from vlmserve.models.quant.int4 import int4_applies, keep_packed

    names = weight_names(model_dir)
    table = getattr(model, "weight_table", None)
    if names is None or table is None or not int4_applies(packed, device, tp_size()):
        return frozenset()
    kernel = load_int4_kernel()
    if kernel is None:
        logger.info("%s 4-bit: no int4 CPU kernel here; the weights are dequantized as they load", packed.method)
        return frozenset()
    return keep_packed(model, table(), names, packed, kernel)


def build_model(
    model_class: Callable[[ModelConfig, AttentionBackend], VLModel],
    config: ModelConfig,
    model_dir: Path,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None = None,
    draft_head: bool = False,
    lm_head: bool = True,
    on_loaded: Callable[[VLModel], None] | None = None,
) -> VLModel:
    """quantization: None (the checkpoint's own: float, or AWQ/GPTQ as published), "int8"
    (weight-only, made here from float weights), "awq" or "gptq" (must match the checkpoint).
    draft_head: build and load the model's speculative-decoding draft head too (Qwen3.5's
    multi-token prediction; its layers cost KV cache, so it is left out unless asked for).
    lm_head: False for a model whose logits nothing reads (a pooling model's embeddings): an
    untied one is neither allocated nor loaded (Qwen3-VL-Embedding's checkpoint has none).
    on_loaded: called with the model once its weights are loaded as the checkpoint has them, before
    any is quantized or reordered (a reranker's pooler reads two lm_head rows there)."""
    packed = read_packed_config(model_dir / "config.json")
    method = resolve_quantization(quantization, packed)
    # Built on the meta device so no memory is spent on random initialisation, then allocated
    # once on the target device and filled from the checkpoint.
    with torch.device("meta"), _default_dtype(dtype), _naming_checkpoint(model_dir):
        model = model_class(dataclasses.replace(config, draft_head=draft_head), backend)
        if draft_head and not model.has_draft_head:
            raise ValueError(f"{type(model).__name__} has no draft head (speculative decoding with method 'mtp')")
        if not lm_head and getattr(model, "lm_head", None) is not None:
            model.lm_head = None  # type: ignore[assignment]
    # AWQ/GPTQ: the Linear layers the int4 kernels take stay 4-bit (models/quant/int4.py); every
    # other module's packed tensors become its float weight on the way in.
    kept_packed = _keep_packed(model, model_dir, packed, device) if packed is not None else frozenset()
    model = model.to_empty(device=device)
    model.tie_weights()
    weights = progress(
        iterate_weights(model_dir), desc="loading weights", total=count_weights(model_dir), unit="tensor", logger=logger
    )
    with weights, _naming_checkpoint(model_dir):
        model.load_weights(weights if packed is None else dequantize_weights(weights, packed, kept_packed))
    if on_loaded is not None:
        on_loaded(model)
    if kept_packed:
        from vlmserve.kernels.int4 import load_int4_kernel
        from vlmserve.models.quant.int4 import finalize_int4

        int4_kernel = load_int4_kernel()
        assert int4_kernel is not None  # _keep_packed kept none without it
        logger.info("%s 4-bit: %d linear layers kept packed; %s", method, finalize_int4(model), int4_kernel.describe())
    if method == "int8":
        from vlmserve.kernels.int8 import load_int8_kernel
        from vlmserve.models.quant.int8 import quantize_int8

        kernel = load_int8_kernel() if device.type == "cpu" else None
        names = quantize_int8(model, kernel)
        logger.info(
            "int8 weight-only: %d linear layers quantized; decode path: %s",
            len(names),
            kernel.describe() if kernel is not None else "dequantize per call",
        )
    # The vision tower runs on oneDNN with its weights reordered once, and the decoder's layers on
    # that layout where vlmserve's kernel reads it (models/prepack.py); only the other layers' shapes
    # are measured for the dispatch.
    encoder = model.vision_encoder()
    tower = encoder if prepacks_vision(device, dtype) else None
    decoder = packable_decoder_layers(model, encoder, device, dtype)
    bind_linear_op(model, select_linear_op(device, dtype, linear_shapes(model, exclude=[tower, *decoder])))
    if tower is not None or decoder:
        with waiting("reordering weights for oneDNN", logger):  # seconds for a 2B
            vision_layers = prepack_linear_layers(tower) if tower is not None else 0
            decoder_layers = prepack_linear_layers(decoder, packed_linear) if decoder else 0
    if tower is not None:
        logger.info("vision tower: %d linear layers on oneDNN, weights prepacked", vision_layers)
    if decoder:
        logger.info(
            "decoder: %d linear layers on weights prepacked for oneDNN (up to %d rows: vlmserve's AVX-512 kernel)",
            decoder_layers,
            PACKED_ROWS,
        )
    if device.type == "cpu":
        move_to_huge_pages(model)  # after the reorder: the plain vision weights are freed, not moved
    if device.type == "cpu":
        # A decoder that can run a whole decode step in one kernel call (models/fused_decode.py:
        # the Qwen2 and dense Qwen3 decoders on reordered bf16 or int8 weights): offered once they
        # are in their final layout.
        hooks = [getattr(m, "enable_fused_decode", None) for m in model.modules()]
        if any([hook() for hook in hooks if callable(hook)]):
            logger.info("decoder: decode and verify steps of up to %d rows in one vlmserve AVX-512 call", FUSED_ROWS)
    model.eval()
    model.requires_grad_(False)
    return model
