"""The Qwen2-VL vision tower (seed 001): patch embedding, 2-D rotary embedding, bidirectional
attention confined to each image frame by cu_seqlens, and the 2x2 patch merger."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.config import VisionConfig
from vlmserve.models.layers import Linear, apply_rotary_qk_fp32, get_activation
from vlmserve.models.parallel import ColumnParallelLinear, RowParallelLinear, head_parts


def vision_rotary_positions(grid_thw: list[tuple[int, int, int]], merge_size: int) -> torch.Tensor:
    """(row, col) of every patch, in the processor's patch order (2x2 merge blocks contiguous),
    repeated for each temporal slice: [num_patches, 2] int64."""
    pieces = []
    for t, h, w in grid_thw:
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        block = (h // merge_size, merge_size, w // merge_size, merge_size)
        rows = rows.reshape(block).permute(0, 2, 1, 3).flatten()
        cols = cols.reshape(block).permute(0, 2, 1, 3).flatten()
        pieces.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(pieces)


def vision_cu_seqlens(grid_thw: list[tuple[int, int, int]]) -> list[int]:
    """Segment boundaries: one attention segment per frame of each image or video."""
    cu = [0]
    for t, h, w in grid_thw:
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu


class VisionRotaryEmbedding:
    """Each patch rotates by its row on the first quarter of the head and by its column on the
    second quarter; the last half repeats them (rotate-half layout). head_dim / 4 frequencies."""

    def __init__(self, head_dim: int, theta: float) -> None:
        dim = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_patches, 2] -> cos, sin [num_patches, head_dim] float32."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [n, 2, head_dim / 4]
        freqs = freqs.flatten(1)  # [row freqs | col freqs]
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
        # Rotary applied in float32 (as the reference), then back to the activation dtype.
        q, k = apply_rotary_qk_fp32(q, k, cos, sin)
        out = self.backend.varlen_attention(q, k, v, cu_seqlens, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear.split(dim, [hidden_dim], bias=True)
        self.fc2 = RowParallelLinear(hidden_dim, dim, bias=True)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.attn = VisionAttention(config.embed_dim, config.num_heads, backend)
        self.mlp = VisionMLP(config.embed_dim, int(config.embed_dim * config.mlp_ratio), config.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


def _layer_norm(dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=1e-6)


class PatchMerger(nn.Module):
    """Normalise each patch (LayerNorm; Qwen2.5-VL: RMSNorm), concatenate each 2x2 block
    (contiguous in patch order), then a two-layer GELU MLP to the language model's width."""

    def __init__(
        self, out_dim: int, context_dim: int, merge_size: int, norm: Callable[[int], nn.Module] = _layer_norm
    ) -> None:
        super().__init__()
        self.hidden = context_dim * merge_size**2
        self.ln_q = norm(context_dim)
        self.mlp = nn.Sequential(
            ColumnParallelLinear.split(self.hidden, [self.hidden], bias=True),
            nn.GELU(),
            RowParallelLinear(self.hidden, out_dim, bias=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d with stride == kernel over one patch is a matrix product with the
    flattened patch (channel, temporal, row, col order, as the processor lays it out); stored as a
    Linear of [embed_dim, patch_dim] (a conv on the CPU is several times slower)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.proj = Linear(config.patch_dim, config.embed_dim, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.rotary = VisionRotaryEmbedding(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList([VisionBlock(config, backend) for _ in range(config.depth)])
        self.merger = PatchMerger(config.hidden_size, config.embed_dim, config.spatial_merge_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [num_patches, patch_dim] -> [num_patches / merge_size**2, hidden_size]."""
        x = self.patch_embed(pixel_values)
        positions = vision_rotary_positions(grid_thw, self.config.spatial_merge_size).to(x.device)
        cos, sin = self.rotary(positions)
        cu_seqlens = vision_cu_seqlens(grid_thw)
        assert cu_seqlens[-1] == x.shape[0], f"grids hold {cu_seqlens[-1]} patches, pixel_values {x.shape[0]}"
        for block in self.blocks:
            x = block(x, cos, sin, cu_seqlens)
        return self.merger(x)
