"""The Qwen3-VL vision tower: 16-pixel patches (the Conv3d as a matmul), a learned square grid of
position embeddings resampled bilinearly to each image's patch grid, 2-D rotary attention within
each frame, GELU(tanh) MLPs, the 2x2 patch merger, and DeepStack: after each block named in
deepstack_visual_indexes, the hidden states go through a merger of their own (normalised after
the 2x2 concatenation), giving one more [num_merged_tokens, hidden] feature per such block.

Every part of the tower acts within one frame (one temporal patch): the position embeddings and
rotary angles depend only on (row, col), attention is confined to the frame. So a video encoded
as t items of one temporal patch each gives exactly the rows of the whole video encoded at once;
the processor relies on that (a Qwen3-VL video is one item per temporal patch).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
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


def patch_grid_sizes(grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
    """Each patch's grid (h, w), in the processor's order: [num_patches, 2] int64."""
    return torch.cat([torch.tensor([h, w]).expand(t * h * w, 2) for t, h, w in grid_thw])


def bilinear_taps(positions: torch.Tensor, sizes: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4 rows of a side x side embedding grid each patch reads, and their weights: the grid
    resampled to the image's h x w patches with align_corners (patch 0 on grid row 0, patch h - 1
    on grid row side - 1). positions, sizes [n, 2] -> indices [n, 4] int64, weights [n, 4] float32.

    Worked example: side 48, an image 3 patches high: rows sample the grid at 0, 23.5 and 47, so
    the middle row takes half of grid rows 23 and 24."""
    src = positions.float() * (side - 1) / (sizes - 1).clamp(min=1).float()  # [n, 2]
    floor = src.floor()
    taps = (floor.long()[:, :, None] + torch.arange(2)).clamp(0, side - 1)  # [n, axis, 2]
    weights = (1 - (src[:, :, None] - floor[:, :, None] - torch.arange(2)).abs()).clamp(min=0)  # [n, axis, 2]
    indices = taps[:, 0, :, None] * side + taps[:, 1, None, :]  # [n, 2 rows, 2 cols]
    return indices.reshape(-1, 4), (weights[:, 0, :, None] * weights[:, 1, None, :]).reshape(-1, 4)


class PatchMerger(nn.Module):
    """LayerNorm, the m x m block of patches concatenated (contiguous in patch order), then a
    two-layer GELU MLP to the language model's width. The main merger normalises each patch
    before the concatenation; the DeepStack mergers normalise the concatenation (postshuffle)."""

    def __init__(self, config: VisionConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.hidden = config.embed_dim * config.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.hidden if postshuffle_norm else config.embed_dim, eps=1e-6)
        self.linear_fc1 = ColumnParallelLinear.split(self.hidden, [self.hidden], bias=True)
        self.linear_fc2 = RowParallelLinear(self.hidden, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden)) if self.postshuffle_norm else self.norm(x).view(-1, self.hidden)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    def __init__(
        self,
        config: VisionConfig,
        deepstack_visual_indexes: tuple[int, ...],
        num_positions: int,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.config = config
        width = config.intermediate_size
        assert width is not None, "a Qwen3-VL vision config has intermediate_size"
        self.patch_embed = PatchEmbed(config, bias=True)
        self.pos_embed = nn.Embedding(num_positions, config.embed_dim)
        self.grid_side = int(num_positions**0.5)
        self.rotary = VisionRotary(config.head_dim, config.rope_theta)
        # The MLP's layers under the checkpoint's names.
        mlp = partial(VisionMLP, config.embed_dim, width, config.hidden_act, ("linear_fc1", "linear_fc2"))
        self.blocks = nn.ModuleList([VisionBlock(config, backend, layer_norm, mlp) for _ in range(config.depth)])
        self.merger = PatchMerger(config, postshuffle_norm=False)
        self.deepstack_visual_indexes = deepstack_visual_indexes
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(config, postshuffle_norm=True) for _ in deepstack_visual_indexes]
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [num_patches, patch_dim] -> [1 + num_deepstack, num_patches / m**2, hidden]:
        row 0 the merger's output, row 1 + k the DeepStack feature of deepstack_visual_indexes[k]."""
        device = pixel_values.device
        cu_seqlens = frame_cu_seqlens(grid_thw)
        assert cu_seqlens[-1] == pixel_values.shape[0], (
            f"grids hold {cu_seqlens[-1]} patches, pixel_values {pixel_values.shape[0]}"
        )
        positions = patch_positions(grid_thw, self.config.spatial_merge_size)
        indices, weights = bilinear_taps(positions, patch_grid_sizes(grid_thw), self.grid_side)
        x = self.patch_embed(pixel_values)  # [num_patches, embed_dim]
        # float32 weights promote the sum to float32, rounded once to the activation dtype (as the reference).
        pos = (self.pos_embed(indices.to(device)) * weights.to(device)[..., None]).sum(1)
        x = x + pos.to(x.dtype)
        cos, sin = self.rotary(positions.to(device))
        features: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cu_seqlens)
            if i in self.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)]
                features.append(merger(x))
        return torch.stack([self.merger(x), *features])
