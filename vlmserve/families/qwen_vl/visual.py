"""Qwen-VL-Chat's vision tower: a 448 px ViT and the Resampler (the paper's VL adapter).

    pixels [B, 3, 448, 448] -> conv1: 14 x 14 patches (a matrix product) -> [B, 1024, width]
    + positional_embedding (256 learned rows = a 16 x 16 grid, bicubically resized to 32 x 32)
    -> ln_pre -> `layers` pre-LayerNorm blocks (GELU MLP), attention over each image's patches
    -> attn_pool: 256 learned queries attend over the 1024 patches (2-D sin-cos positions on both)
    -> ln_post -> @ proj -> [B, 256, output_dim]

Parameter names are the published checkpoint's, under transformer.visual.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.families.qwen_vl.config import QwenVisualConfig
from vlmserve.models.layers import Linear

LAYER_NORM_EPS = 1e-6  # partial(nn.LayerNorm, eps=1e-6) for every norm of the tower


def resize_pos_embed(pos: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The reference's get_abs_pos: a [L, C] table laid out as a sqrt(L) x sqrt(L) grid, resized
    bicubically (in float32, align_corners=False) to sqrt(num_tokens) x sqrt(num_tokens) rows.
    At 448 px the 256-row tables (16 x 16) become 1024 rows (32 x 32)."""
    src, tgt = math.isqrt(pos.shape[0]), math.isqrt(num_tokens)
    if src == tgt:
        return pos
    grid = pos.float().reshape(1, src, src, -1).permute(0, 3, 1, 2)  # [1, C, src, src]
    out = F.interpolate(grid, size=(tgt, tgt), mode="bicubic", align_corners=False)
    return out.permute(0, 2, 3, 1).flatten(0, 2).to(pos.dtype)  # [tgt * tgt, C]


def sincos_pos_embed_2d(dim: int, grid_size: int) -> torch.Tensor:
    """The Resampler's fixed position table [grid_size**2, dim] (MAE's 2-D sin-cos, as the
    reference computes it in numpy float32): row r = (y, x) in row-major order; the first half of
    the channels encodes x, the second half y, each as [sin | cos] of pos / 10000**(2i / (dim / 2))."""
    assert dim % 4 == 0, "2-D sin-cos needs dim divisible by 4"
    grid_w, grid_h = np.meshgrid(np.arange(grid_size, dtype=np.float32), np.arange(grid_size, dtype=np.float32))

    def one_axis(pos: np.ndarray) -> np.ndarray:
        omega = np.arange(dim // 4, dtype=np.float32) / np.float32(dim / 4)
        omega = np.float32(1.0) / np.float32(10000) ** omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    # The reference's grid[0] is the meshgrid's first output, which varies along w.
    return torch.from_numpy(np.concatenate([one_axis(grid_w), one_axis(grid_h)], axis=1)).float()


def patchify(pixel_values: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[B, 3, S, S] -> [B, (S / p)**2, 3 * p * p]: patches in row-major order, each flattened in
    (channel, row, col) order, which is how conv1's kernel flattens."""
    b, c, h, w = pixel_values.shape
    gh, gw = h // patch_size, w // patch_size
    x = pixel_values.reshape(b, c, gh, patch_size, gw, patch_size).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, gh * gw, c * patch_size * patch_size)


class VisualAttention(nn.Module):
    """Self-attention over one image's patches. in_proj's output is laid out per head
    ([q | k | v] of head_dim each, head after head: Megatron's layout), not [q | k | v]."""

    def __init__(self, dim: int, num_heads: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.in_proj = Linear(dim, 3 * dim, bias=True)
        self.out_proj = Linear(dim, dim, bias=True)
        self.backend = backend

    def forward(self, x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.in_proj(x).view(n, self.num_heads, 3 * self.head_dim)
        q, k, v = qkv.split(self.head_dim, dim=-1)  # each [num_tokens, num_heads, head_dim]
        out = self.backend.varlen_attention(q, k, v, cu_seqlens, self.head_dim**-0.5)
        return self.out_proj(out.reshape(n, -1))


class VisualMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.c_fc = Linear(dim, hidden_dim)
        self.c_proj = Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))  # nn.GELU: the exact (erf) form


class VisualAttentionBlock(nn.Module):
    def __init__(self, config: QwenVisualConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.width, eps=LAYER_NORM_EPS)
        self.ln_2 = nn.LayerNorm(config.width, eps=LAYER_NORM_EPS)
        self.attn = VisualAttention(config.width, config.heads, backend)
        self.mlp = VisualMLP(config.width, config.mlp_width)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cu_seqlens)
        return x + self.mlp(self.ln_2(x))


class TransformerBlock(nn.Module):
    """Holds the blocks as `resblocks`, the reference's (and so the checkpoint's) name."""

    def __init__(self, config: QwenVisualConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.resblocks = nn.ModuleList([VisualAttentionBlock(config, backend) for _ in range(config.layers)])


class ResamplerAttention(nn.Module):
    """nn.MultiheadAttention's parameters (in_proj_weight = [W_q; W_k; W_v], in_proj_bias,
    out_proj) and arithmetic: heads are contiguous slices of each projection."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * dim))
        self.out_proj = Linear(dim, dim, bias=True)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [num_queries, dim] (the same for every image); key, value [B, num_patches, dim]
        -> [B, num_queries, dim]."""
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        b, n, dim = key.shape
        q = F.linear(query, w_q, b_q).view(1, -1, self.num_heads, self.head_dim).transpose(1, 2)
        k = F.linear(key, w_k, b_k).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        v = F.linear(value, w_v, b_v).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        # [B, num_heads, num_queries, head_dim]; no mask: every query sees every patch.
        out = F.scaled_dot_product_attention(q.expand(b, -1, -1, -1), k, v)
        return self.out_proj(out.transpose(1, 2).reshape(b, -1, dim))


class Resampler(nn.Module):
    """attn_pool: n_queries learned queries cross-attend over the patches. Queries carry the
    16 x 16 sin-cos table, keys the same table resized to the patch grid; values carry none."""

    def __init__(self, config: QwenVisualConfig) -> None:
        super().__init__()
        dim = config.output_dim
        self.query = nn.Parameter(torch.empty(config.n_queries, dim))
        # Fixed (requires_grad False in the reference) but a parameter, so it is in the checkpoint.
        self.pos_embed = nn.Parameter(torch.empty(config.n_queries, dim))
        # The reference projects only when the widths differ (nn.Identity otherwise: no weight).
        self.kv_proj: nn.Module = Linear(config.width, dim, bias=False) if config.width != dim else nn.Identity()
        self.attn = ResamplerAttention(dim, config.resampler_heads)
        self.ln_q = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)
        self.ln_kv = nn.LayerNorm(dim, eps=LAYER_NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, num_patches, width] -> [B, n_queries, output_dim]."""
        key_pos = resize_pos_embed(self.pos_embed, x.shape[1])  # [num_patches, output_dim]
        x = self.ln_kv(self.kv_proj(x))
        q = self.ln_q(self.query) + self.pos_embed
        return self.attn(q, x + key_pos, x)


class QwenVisionTransformer(nn.Module):
    def __init__(self, config: QwenVisualConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        p = config.patch_size
        # The checkpoint's Conv2d(3, width, p, stride=p, bias=False) as a Linear over flattened
        # patches ([width, 3 * p * p]; reshaped when loaded).
        self.conv1 = Linear(3 * p * p, config.width, bias=False)
        # 256 rows whatever the image size (the reference hard-codes it), resized to the patch grid.
        self.positional_embedding = nn.Parameter(torch.empty(256, config.width))
        self.ln_pre = nn.LayerNorm(config.width, eps=LAYER_NORM_EPS)
        self.transformer = TransformerBlock(config, backend)
        self.attn_pool = Resampler(config)
        self.ln_post = nn.LayerNorm(config.output_dim, eps=LAYER_NORM_EPS)
        self.proj = nn.Parameter(torch.empty(config.output_dim, config.output_dim))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, 3, image_size, image_size] (resized and normalised) -> [B, n_queries, output_dim]."""
        size = self.config.image_size
        assert pixel_values.shape[1:] == (3, size, size), f"expected [B, 3, {size}, {size}], got {pixel_values.shape}"
        x = self.conv1(patchify(pixel_values.to(self.conv1.weight.dtype), self.config.patch_size))
        b, n, width = x.shape  # [B, num_patches, width]
        x = self.ln_pre(x + resize_pos_embed(self.positional_embedding, n))
        # Images laid end to end; attention stays within each image.
        cu_seqlens = list(range(0, b * n + 1, n))
        h = x.reshape(b * n, width)
        for block in self.transformer.resblocks:
            h = block(h, cu_seqlens)
        x = self.ln_post(self.attn_pool(h.view(b, n, width)))
        return x @ self.proj  # proj is [in, out]: x @ proj, not a Linear's x @ W.T
