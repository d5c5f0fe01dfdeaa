"""The Qwen2.5-VL vision tower: Qwen2-VL's patch embedding, 2-D rotary embedding and
attention, with RMSNorm, a SwiGLU MLP, and window attention in all but a few full-frame blocks.

Window attention: the merged tokens of each frame are tiled into windows of
window_size / patch_size / spatial_merge_size merged tokens per side (4 x 4 for the published
112 px), partial at the bottom and right edges. The patches are permuted once, before the first
block, so that each window's patches are contiguous (a merged token's m x m patches stay together,
so the merger still sees them as one block); windowed blocks then attend within
[cu_window_seqlens[i], cu_window_seqlens[i + 1]), the blocks in fullatt_block_indexes within each
frame (the permutation keeps frames contiguous, so Qwen2-VL's per-frame cu_seqlens still hold).
The merger's output is permuted back to the processor's order.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.config import VisionConfig
from vlmserve.families.common.vision import (
    PatchEmbed,
    SwiGLUVisionMLP,
    VisionBlock,
    VisionRotary,
    frame_cu_seqlens,
    patch_positions,
)
from vlmserve.families.qwen2_vl.vision import PatchMerger
from vlmserve.models.layers import RMSNorm


def window_partition(
    grid_thw: list[tuple[int, int, int]], merge_size: int, window: int
) -> tuple[torch.Tensor, list[int]]:
    """The merged tokens (in the processor's order, numbered across all items) reordered window by
    window, [num_merged_tokens] int64, and the windows' boundaries in patches (cu_seqlens).

    Worked example: one image whose merged grid is 3 x 5 (grid_thw (1, 6, 10), merge 2), windows
    of 4 x 4 merged tokens. Merged token r * 5 + c sits at row r, column c:

         0  1  2  3 |  4
         5  6  7  8 |  9
        10 11 12 13 | 14

    The first window holds columns 0..3, the second (partial) column 4, so the order is
    0 1 2 3 5 6 7 8 10 11 12 13 4 9 14 and cu_window_seqlens [0, 48, 60] (12 and 3 merged tokens
    of 4 patches each). Video frames are windowed one after the other.
    """
    order: list[torch.Tensor] = []
    cu_seqlens = [0]
    patches_per_token = merge_size**2
    first = 0  # number of the item's first merged token
    for t, h, w in grid_thw:
        gh, gw = h // merge_size, w // merge_size
        tokens = torch.arange(first, first + t * gh * gw).view(t, gh, gw)
        # Row-major over windows; each window [t, rows * cols], row-major inside.
        windows = [
            tokens[:, r : r + window, c : c + window].reshape(t, -1)
            for r in range(0, gh, window)
            for c in range(0, gw, window)
        ]
        order.append(torch.cat(windows, dim=1).flatten())  # frame by frame, window by window
        for _ in range(t):
            for win in windows:
                cu_seqlens.append(cu_seqlens[-1] + win.shape[1] * patches_per_token)
        first += t * gh * gw
    return torch.cat(order), cu_seqlens


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        width = config.intermediate_size
        assert width is not None, "a Qwen2.5-VL vision config has intermediate_size"
        self.patch_embed = PatchEmbed(config, bias=False)
        self.rotary = VisionRotary(config.head_dim, config.rope_theta)
        # RMSNorm, and a SwiGLU MLP with biases (the checkpoint's gate_proj / up_proj fused).
        mlp = partial(SwiGLUVisionMLP, config.embed_dim, width, config.hidden_act)
        self.blocks = nn.ModuleList([VisionBlock(config, backend, RMSNorm, mlp) for _ in range(config.depth)])
        self.merger = PatchMerger(config.hidden_size, config.embed_dim, config.spatial_merge_size, norm=RMSNorm)
        self.fullatt_block_indexes = frozenset(config.fullatt_block_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [num_patches, patch_dim] -> [num_patches / merge_size**2, hidden_size], in
        the processor's order."""
        m = self.config.spatial_merge_size
        cu_seqlens = frame_cu_seqlens(grid_thw)  # per frame, for the full-attention blocks
        assert cu_seqlens[-1] == pixel_values.shape[0], (
            f"grids hold {cu_seqlens[-1]} patches, pixel_values {pixel_values.shape[0]}"
        )
        # Index work on the CPU, once per forward.
        window_order, cu_window_seqlens = window_partition(grid_thw, m, self.config.merged_window_size)
        # Patch p of merged token k is patch k * m*m + p: move each token's patches together.
        patch_order = (window_order[:, None] * m**2 + torch.arange(m**2)).flatten()  # [num_patches]
        positions = patch_positions(grid_thw, m)[patch_order]  # [num_patches, 2]

        device = pixel_values.device
        x = self.patch_embed(pixel_values[patch_order.to(device)])  # [num_patches, embed_dim], window order
        cos, sin = self.rotary(positions.to(device))
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cu_seqlens if i in self.fullatt_block_indexes else cu_window_seqlens)
        merged = self.merger(x)  # [num_merged_tokens, hidden_size], window order
        return merged[torch.argsort(window_order).to(device)]
