"""The Qwen2-VL vision tower: patch embedding, 2-D rotary embedding, bidirectional
attention confined to each image frame by cu_seqlens (the blocks: families/common/vision.py),
and the 2x2 patch merger."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.config import VisionConfig
from vlmserve.families.common.vision import (
    PatchEmbed,
    VisionBlock,
    VisionMLP,
    VisionRotary,
    frame_cu_seqlens,
    layer_norm,
    patch_positions,
)
from vlmserve.models.parallel import ColumnParallelLinear, RowParallelLinear


class PatchMerger(nn.Module):
    """Normalise each patch (LayerNorm; Qwen2.5-VL: RMSNorm), concatenate each 2x2 block
    (contiguous in patch order), then a two-layer GELU MLP to the language model's width."""

    def __init__(
        self, out_dim: int, context_dim: int, merge_size: int, norm: Callable[[int], nn.Module] = layer_norm
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


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config, bias=False)
        self.rotary = VisionRotary(config.head_dim, config.rope_theta)
        mlp_width = int(config.embed_dim * config.mlp_ratio)
        mlp = partial(VisionMLP, config.embed_dim, mlp_width, config.hidden_act)
        self.blocks = nn.ModuleList([VisionBlock(config, backend, layer_norm, mlp) for _ in range(config.depth)])
        self.merger = PatchMerger(config.hidden_size, config.embed_dim, config.spatial_merge_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [num_patches, patch_dim] -> [num_patches / merge_size**2, hidden_size]."""
        x = self.patch_embed(pixel_values)
        positions = patch_positions(grid_thw, self.config.spatial_merge_size).to(x.device)
        cos, sin = self.rotary(positions)
        cu_seqlens = frame_cu_seqlens(grid_thw)
        assert cu_seqlens[-1] == x.shape[0], f"grids hold {cu_seqlens[-1]} patches, pixel_values {x.shape[0]}"
        for block in self.blocks:
            x = block(x, cos, sin, cu_seqlens)
        return self.merger(x)
