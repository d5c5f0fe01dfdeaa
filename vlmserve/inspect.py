"""What a model is made of, from its config.json alone: parameters per part and the memory its
weights, KV cache and (for linear-attention layers) per-request state need in a dtype. The model
is built on the meta device (no weights, no memory), so the counts are those of the very modules
vlmserve runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vlmserve.attention import TorchAttentionBackend
from vlmserve.attention.layer import PagedAttention
from vlmserve.attention.state import SequenceState
from vlmserve.config import ModelConfig
from vlmserve.distributed import simulated_tensor_parallel
from vlmserve.model_files import config_json_path
from vlmserve.models.quant.packed import PackedConfig
from vlmserve.models.quant.sizes import quantized_weight_bytes
from vlmserve.registry import family_of, load_model_config


@dataclass(frozen=True)
class ModelReport:
    architecture: str
    model_type: str
    embedding: int
    block: list[int]  # one entry per decoder block
    final_norm: int
    lm_head: int  # 0 when tied to the embedding
    tied: bool
    visual: int  # the whole vision tower, its adapter included
    adapter: int  # Qwen-VL's resampler, Qwen2-VL's patch merger
    adapter_name: str
    total: int
    # Parameters one token uses: the total less the experts a router does not pick (MoE).
    active: int
    dtype: torch.dtype
    kv_bytes_per_token: int
    kv_layout: str
    # Fixed-size state each running request holds (linear attention's conv window and recurrent
    # state); 0 for a model without.
    state_bytes_per_request: int = 0
    state_layout: str = ""
    # Under a quantization method (int8, or the checkpoint's AWQ/GPTQ): its description, the
    # bytes of all weights, and the linear layers it quantizes.
    quantization: str = ""
    quantized_bytes: int = 0
    quantized_linears: int = 0
    # Under tensor parallelism (tensor_parallel_size > 1): the weight bytes and the KV cache bytes
    # per token each rank holds, rank 0 first (the model built as that rank's shard).
    rank_weight_bytes: tuple[int, ...] = ()
    rank_kv_bytes_per_token: tuple[int, ...] = ()

    @property
    def blocks(self) -> int:
        return sum(self.block)

    @property
    def weight_bytes(self) -> int:
        return self.total * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _unrouted(model: nn.Module) -> int:
    """Expert parameters a token does not use: of each module of routed experts (one that says
    num_experts and num_experts_per_tok), all but num_experts_per_tok / num_experts."""
    unused = 0
    for module in model.modules():
        experts, per_token = getattr(module, "num_experts", None), getattr(module, "num_experts_per_tok", None)
        if isinstance(experts, int) and isinstance(per_token, int):
            unused += _count(module) * (experts - per_token) // experts
    return unused


def load_config(path: str | Path) -> ModelConfig:
    """A config.json, or a checkpoint directory holding one."""
    return load_model_config(config_json_path(path))


def _kv_bytes_per_token(model: nn.Module, dtype: torch.dtype) -> int:
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    return sum(2 * m.num_kv_heads * m.head_dim for m in layers) * _itemsize(dtype)


def rank_shares(config: ModelConfig, dtype: torch.dtype, tensor_parallel_size: int) -> tuple[list[int], list[int]]:
    """(weight bytes, KV cache bytes per token) of each rank: the model built on the meta device
    as each rank's shard (a simulated group: nothing runs)."""
    family = family_of(config)
    weights, kv = [], []
    for rank in range(tensor_parallel_size):
        with simulated_tensor_parallel(rank, tensor_parallel_size), torch.device("meta"):
            model = family.model_class(config, TorchAttentionBackend())
        weights.append(_count(model) * _itemsize(dtype))
        kv.append(_kv_bytes_per_token(model, dtype))
    return weights, kv


def inspect_config(
    config: ModelConfig,
    dtype: torch.dtype,
    quantization: str | PackedConfig | None = None,
    tensor_parallel_size: int = 1,
) -> ModelReport:
    """tensor_parallel_size > 1 adds each rank's share (a family that cannot be sharded, or
    head counts that do not divide, raise ValueError)."""
    family = family_of(config)
    rank_weights, rank_kv = rank_shares(config, dtype, tensor_parallel_size) if tensor_parallel_size > 1 else ([], [])
    with torch.device("meta"):
        model = family.model_class(config, TorchAttentionBackend())
    parts = family.inspect_parts
    blocks = model.get_submodule(parts["blocks"])
    assert isinstance(blocks, nn.ModuleList)
    lm_head = getattr(model, "lm_head", None)
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    per_token = _kv_bytes_per_token(model, dtype)
    first = layers[0]
    states = [m for m in model.modules() if isinstance(m, SequenceState)]
    state_layout = ""
    if states:
        pieces = [
            " x ".join(str(n) for n in shape) + f" {str(kind or dtype).removeprefix('torch.')}"
            for shape, kind in states[0].shapes
        ]
        state_layout = f"{len(states)} layers x ({' + '.join(pieces)})"
    quant_bytes, quant_linears, quant_name = 0, 0, ""
    if quantization is not None:
        embedding = model.get_submodule(parts["embedding"])
        tied_shape = tuple(embedding.weight.shape) if lm_head is None and isinstance(embedding, nn.Embedding) else None
        quant_bytes, quant_linears = quantized_weight_bytes(model, _itemsize(dtype), quantization, tied_shape)  # type: ignore[arg-type]
        quant_name = (
            "int8 weight-only, per-channel scales"
            if quantization == "int8"
            else f"{quantization.method} 4-bit, group {quantization.group_size}"  # type: ignore[union-attr]
        )
    return ModelReport(
        architecture=config.architecture,
        model_type=config.model_type,
        embedding=_count(model.get_submodule(parts["embedding"])),
        block=[_count(b) for b in blocks],
        final_norm=_count(model.get_submodule(parts["final_norm"])),
        lm_head=_count(lm_head) if lm_head is not None else 0,
        tied=lm_head is None,
        visual=_count(model.get_submodule(parts["visual"])),
        adapter=_count(model.get_submodule(parts["adapter"])),
        adapter_name=family.adapter_name,
        total=_count(model),  # a tied lm_head is not built on the meta device, so not counted twice
        active=_count(model) - _unrouted(model),
        dtype=dtype,
        kv_bytes_per_token=per_token,
        kv_layout=f"{len(layers)} layers x (K + V) x {first.num_kv_heads} KV heads x {first.head_dim}",
        state_bytes_per_request=sum(m.slot_bytes(dtype) for m in states),
        state_layout=state_layout,
        quantization=quant_name,
        quantized_bytes=quant_bytes,
        quantized_linears=quant_linears,
        rank_weight_bytes=tuple(rank_weights),
        rank_kv_bytes_per_token=tuple(rank_kv),
    )


def _bytes(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:.2f} GiB)" if n >= 2**30 else f"{n:,} bytes ({n / 2**20:.2f} MiB)"


def format_report(r: ModelReport) -> str:
    dtype = str(r.dtype).removeprefix("torch.")
    n = len(r.block)
    same = len(set(r.block)) == 1
    rows = [
        ("embedding", r.embedding),
        (f"decoder block (each of {n})" if same else "decoder block 0", r.block[0]),
        (f"decoder blocks (all {n})", r.blocks),
        ("final norm", r.final_norm),
        ("lm_head" + (" (tied to the embedding)" if r.tied else ""), r.lm_head),
        ("vision tower (adapter included)", r.visual),
        (f"  {r.adapter_name}", r.adapter),
        ("total", r.total),
    ]
    if r.active != r.total:
        rows.append(("active per token (routed experts)", r.active))
    lines = [f"{r.architecture} (model_type {r.model_type!r}), parameters:"]
    lines += [f"  {name:<40} {count:>16,}" for name, count in rows]
    lines.append(f"weights in {dtype}: {_bytes(r.weight_bytes)}")
    if r.quantization:
        lines.append(
            f"weights {r.quantization} ({r.quantized_linears} linear layers; the rest in {dtype}): "
            f"{_bytes(r.quantized_bytes)}"
        )
    per_token = r.kv_bytes_per_token
    lines.append(f"KV cache per token in {dtype}: {per_token:,} bytes ({per_token / 2**10:.0f} KiB; {r.kv_layout})")
    if r.rank_weight_bytes:
        n_ranks = len(r.rank_weight_bytes)
        lines.append(f"tensor parallel, {n_ranks} ranks (weights in {dtype}; KV cache per token):")
        lines += [
            f"  rank {rank}: weights {_bytes(w)}, KV cache {kv:,} bytes per token"
            for rank, (w, kv) in enumerate(zip(r.rank_weight_bytes, r.rank_kv_bytes_per_token, strict=True))
        ]
    if r.state_bytes_per_request:
        lines.append(f"state per request: {_bytes(r.state_bytes_per_request)} ({r.state_layout})")
    return "\n".join(lines)
