"""The blocks of the Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers (Qwen3.5 has Qwen3-VL's):
patches embedded by a matmul, 2-D rotary attention confined to each frame (or window), an MLP,
a norm before each. Every tower lays out a frame's patches as the processor does: each
merge_size x merge_size block of patches contiguous, so the merger sees a block as one row."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.config import VisionConfig
from vlmserve.models.layers import Linear, apply_rotary_qk_fp32, get_activation
from vlmserve.models.parallel import ColumnParallelLinear, RowParallelLinear, head_parts


def patch_positions(grid_thw: list[tuple[int, int, int]], merge_size: int) -> torch.Tensor:
    """(row, col) of every patch, in the processor's patch order (merge blocks contiguous),
    repeated for each temporal patch: [num_patches, 2] int64."""
    pieces = []
    m = merge_size
    for t, h, w in grid_thw:
        rows = torch.arange(h)[:, None].expand(h, w).reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
        cols = torch.arange(w)[None, :].expand(h, w).reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
        pieces.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(pieces)


def frame_cu_seqlens(grid_thw: list[tuple[int, int, int]]) -> list[int]:
    """Segment boundaries: one attention segment per frame (temporal patch) of each image or video."""
    cu = [0]
    for t, h, w in grid_thw:
        base = cu[-1]
        cu.extend(base + h * w * (k + 1) for k in range(t))
    return cu


class VisionRotary:
    """head_dim / 4 frequencies: the first quarter of the head rotates by the patch's row, the
    second by its column; the second half repeats them (rotate-half layout)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        dim = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n, 2] -> cos, sin [n, head_dim] float32."""
        freqs = (positions[..., None].float() * self.inv_freq.to(positions.device)).flatten(1)  # [row | col freqs]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        # This rank's heads: the checkpoint's fused [q | k | v] rows narrowed head-wise in each part.
        q, k, v, self.num_heads, _ = head_parts(num_heads, num_heads, self.head_dim, "the vision tower")
        self.qkv = ColumnParallelLinear(dim, [q, k, v], bias=True)
        self.proj = RowParallelLinear(dim, dim, bias=True)
        self.backend = backend

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        # Rotary in float32 (as the reference), then back to the activation dtype.
        q, k = apply_rotary_qk_fp32(q, k, cos, sin)
        out = self.backend.varlen_attention(q, k, v, cu_seqlens, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    """fc2(act(fc1(x))), with biases; the two layers go by the checkpoint's names for them
    (`names`: Qwen2-VL's ("fc1", "fc2"), Qwen3-VL's ("linear_fc1", "linear_fc2"))."""

    def __init__(self, dim: int, hidden_dim: int, act: str, names: tuple[str, str] = ("fc1", "fc2")) -> None:
        super().__init__()
        self.names = names
        self.add_module(names[0], ColumnParallelLinear.split(dim, [hidden_dim], bias=True))
        self.add_module(names[1], RowParallelLinear(hidden_dim, dim, bias=True))
        self.act_name = act
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = (cast(Linear, self.get_submodule(name)) for name in self.names)
        hidden = fc1.forward_activated(x, self.act_name)  # one oneDNN pass where it applies
        return fc2(self.act(fc1(x)) if hidden is None else hidden)


class SwiGLUVisionMLP(nn.Module):
    """Qwen2.5-VL's: down(act(gate(x)) * up(x)) with biases; gate and up fused into one matmul
    (loaded from the checkpoint's gate_proj / up_proj)."""

    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.split(dim, [hidden_dim, hidden_dim], bias=True, names=("0", "1"))
        self.down_proj = RowParallelLinear(hidden_dim, dim, bias=True)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


def layer_norm(dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x)); `norm` makes the tower's norm (LayerNorm, or
    Qwen2.5-VL's RMSNorm) for a width, `mlp` its MLP (built after the attention, so a width that
    does not shard is reported after the heads)."""

    def __init__(
        self,
        config: VisionConfig,
        backend: AttentionBackend,
        norm: Callable[[int], nn.Module],
        mlp: Callable[[], nn.Module],
    ) -> None:
        super().__init__()
        self.norm1 = norm(config.embed_dim)
        self.norm2 = norm(config.embed_dim)
        self.attn = VisionAttention(config.embed_dim, config.num_heads, backend)
        self.mlp = mlp()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d with stride == kernel over one patch is a matrix product with the
    flattened patch (channel, temporal, row, col order, as the processor lays it out); stored as a
    Linear of [embed_dim, patch_dim] (a conv on the CPU is several times slower). Qwen3-VL's has a
    bias, Qwen2-VL's none."""

    def __init__(self, config: VisionConfig, bias: bool) -> None:
        super().__init__()
        self.proj = Linear(config.patch_dim, config.embed_dim, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))
