"""Published 4-bit checkpoints (AutoAWQ's GEMM layout, GPTQ's) unpacked into float weights as they
stream from the files: a module's `qweight`, `qzeros`, `scales` (and GPTQ's `g_idx`) become one
`weight` [out_features, in_features] that the family's weight table loads like any other.

The layouts (learned from AutoAWQ, AutoGPTQ, vLLM and transformers; written here from scratch):

AWQ, version "gemm" (zero_point true), for a linear of in_features K and out_features N:
  qweight int32 [K, N / 8]: element [k, j] holds w_int[k, 8j .. 8j+7], 4 bits each, in the
    interleaved order AWQ_ORDER: bits 4i..4i+3 hold column 8j + AWQ_ORDER[i];
  qzeros  int32 [K / group, N / 8]: the zero points, packed the same way;
  scales  float [K / group, N];
  w[n, k] = (w_int[k, n] - zero[k // group, n]) * scale[k // group, n].

GPTQ (checkpoint_format "gptq", the AutoGPTQ / exllama v1 format):
  qweight int32 [K / 8, N]: packed along the input dimension in plain order: bits 4i..4i+3 of
    element [r, n] hold w_int[8r + i, n];
  qzeros  int32 [groups, N / 8]: packed along the output dimension in plain order, each stored
    as zero - 1 (v1's off-by-one; "gptq_v2" stores the zero itself);
  scales  float [groups, N];
  g_idx   int32 [K]: the group of each input row (k // group when desc_act is false; with
    desc_act, rows were quantized in order of activation size, so groups are scattered);
  w[n, k] = (w_int[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n].
  sym true is the same arithmetic with every zero 8.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

BITS = 4
PACK = 32 // BITS  # values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# AWQ_REVERSE_ORDER[c] is the nibble holding column c of a pack of 8 (the inverse permutation).
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(c) for c in range(PACK))
PACKED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class PackedConfig:
    method: str  # "awq" | "gptq"
    group_size: int  # -1: one group over the whole input dimension
    desc_act: bool = False
    zero_point_offset: int = 0  # GPTQ v1 stores zero - 1: 1 there, 0 for AWQ and gptq_v2


def _unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> int32 [..., C, 8] of the 4-bit fields, field i = bits 4i..4i+3."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32)
    return (packed.to(torch.int32)[..., None] >> shifts) & 0xF


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ GEMM's packed columns -> (w_int [K, N], zeros [groups, N]), both int32 in 0..15."""
    order = torch.tensor(AWQ_REVERSE_ORDER)
    w = _unpack_int32(qweight)[..., order].reshape(qweight.shape[0], -1)
    z = _unpack_int32(qzeros)[..., order].reshape(qzeros.shape[0], -1)
    return w, z


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's packed rows and zeros -> (w_int [K, N], zeros [groups, N] as stored), int32 0..15."""
    # [K / 8, N, 8] -> [K / 8, 8, N] -> [K, N]: field i of row r is input row 8r + i.
    w = _unpack_int32(qweight).permute(0, 2, 1).reshape(-1, qweight.shape[1])
    z = _unpack_int32(qzeros).reshape(qzeros.shape[0], -1)
    return w, z


def _integers(
    config: PackedConfig, parts: dict[str, torch.Tensor], name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One module's packed tensors -> (w_int [K, N], zeros [groups, N], scales [groups, N] fp32,
    g_idx [K] int64: each input row's group), checked against each other."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"].float()
    if config.method == "awq":
        w_int, zeros = unpack_awq(qweight, qzeros)
        in_features = w_int.shape[0]
        group = config.group_size if config.group_size > 0 else in_features
        g_idx = torch.arange(in_features) // group
    else:
        w_int, zeros = unpack_gptq(qweight, qzeros)
        zeros = zeros + config.zero_point_offset
        in_features = w_int.shape[0]
        if "g_idx" in parts:
            g_idx = parts["g_idx"].to(torch.int64)
        else:
            group = config.group_size if config.group_size > 0 else in_features
            g_idx = torch.arange(in_features) // group
    out_features = w_int.shape[1]
    if scales.shape[1] != out_features or zeros.shape != scales.shape or g_idx.shape != (in_features,):
        raise ValueError(
            f"{name}: inconsistent {config.method} tensors: qweight unpacks to [{in_features}, {out_features}], "
            f"scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}, g_idx {tuple(g_idx.shape)}"
        )
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[0]:
        raise ValueError(f"{name}: g_idx points outside the {scales.shape[0]} groups of its scales")
    return w_int, zeros, scales, g_idx


def dequantize(config: PackedConfig, parts: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """One module's packed tensors -> its float32 weight [out_features, in_features]."""
    w_int, zeros, scales, g_idx = _integers(config, parts, name)
    # [K, N]: every input row takes its group's zero and scale (exact in fp32: |w_int - z| <= 16).
    w = (w_int - zeros[g_idx]).float() * scales[g_idx]
    return w.t().contiguous()


def int4_rows(config: PackedConfig, parts: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """One module's packed tensors -> the tensors of an Int4Linear (models/quant/int4.py), one row
    per output so that the weight table fuses them (q, k, v) like float weights:
      qweight int32 [N, K / 8]: element [n, o] holds inputs 8 o + 2 j in bits 4 j .. 4 j + 3 and
        8 o + 2 j + 1 in bits 16 + 4 j .. 19 + 4 j (j = 0..3), the pairs cpu_int4.c reads;
      scales, qzeros fp32 [N, groups] (the zero points as floats);
    the groups in order (int4_applies: no desc_act)."""
    w_int, zeros, scales, g_idx = _integers(config, parts, name)
    in_features, out_features = w_int.shape
    group = in_features // scales.shape[0]
    if in_features % scales.shape[0] or not torch.equal(g_idx, torch.arange(in_features) // group):
        raise ValueError(f"{name}: the groups of its inputs are not in order; it cannot be kept packed")
    q = w_int.t().reshape(out_features, in_features // 8, 4, 2)  # [N, K / 8, pair j, its two inputs]
    shifts = torch.arange(0, 16, BITS, dtype=torch.int32)
    qweight = ((q[..., 0] << shifts) | (q[..., 1] << (shifts + 16))).sum(-1, dtype=torch.int32)
    return {
        "qweight": qweight.contiguous(),
        "scales": scales.t().contiguous(),
        "qzeros": zeros.t().float().contiguous(),
    }


def dequantize_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: PackedConfig, kept_packed: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass plain tensors through; hold a module's packed tensors until all have arrived, then
    yield its dequantized `<module>.weight`, or for the modules of `kept_packed` (checkpoint
    names) the tensors int4_rows makes. (A file's names come sorted, so a module's parts are
    adjacent and little is held at once.)"""
    needed = {"qweight", "qzeros", "scales"}
    if config.method == "gptq" and config.desc_act:
        needed.add("g_idx")  # scattered groups: the result depends on it
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    for name, tensor in weights:
        module, _, suffix = name.rpartition(".")
        if suffix not in PACKED_SUFFIXES:
            yield name, tensor
            continue
        if module in done:
            # Only a late g_idx of a module without desc_act (groups in order) can come here.
            _check_plain_g_idx(config, module, tensor)
            continue
        parts = pending.setdefault(module, {})
        parts[suffix] = tensor
        if needed <= parts.keys():
            done.add(module)
            if module in kept_packed:
                for suffix, t in int4_rows(config, pending.pop(module), module).items():
                    yield f"{module}.{suffix}", t
            else:
                yield f"{module}.weight", dequantize(config, pending.pop(module), module)
    if pending:
        module, parts = next(iter(pending.items()))
        raise ValueError(f"{module}: the checkpoint holds only {sorted(parts)} of its {config.method} tensors")


def _check_plain_g_idx(config: PackedConfig, module: str, g_idx: torch.Tensor) -> None:
    group = config.group_size if config.group_size > 0 else g_idx.numel()
    if not torch.equal(g_idx.to(torch.int64), torch.arange(g_idx.numel()) // group):
        raise ValueError(f"{module}: g_idx is not in group order but the checkpoint says desc_act false")
