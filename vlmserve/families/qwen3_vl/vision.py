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

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.config import VisionConfig
from vlmserve.models.layers import Linear, apply_rotary_qk_fp32, get_activation
from vlmserve.models.parallel import ColumnParallelLinear, RowParallelLinear, head_parts


def patch_grid_positions(grid_thw: list[tuple[int, int, int]], merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every patch in the processor's order (each m x m merge block contiguous),
    repeated for each temporal patch: [num_patches, 2] int64; and each patch's grid (h, w):
    [num_patches, 2] int64."""
    positions, sizes = [], []
    m = merge_size
    for t, h, w in grid_thw:
        rows = torch.arange(h)[:, None].expand(h, w).reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
        cols = torch.arange(w)[None, :].expand(h, w).reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
        positions.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
        sizes.append(torch.tensor([h, w]).expand(t * h * w, 2))
    return torch.cat(positions), torch.cat(sizes)


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


def frame_cu_seqlens(grid_thw: list[tuple[int, int, int]]) -> list[int]:
    """One attention segment per frame (temporal patch) of each item."""
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
        freqs = (positions[..., None].float() * self.inv_freq.to(positions.device)).flatten(1)  # [n, head_dim / 2]
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
    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear.split(dim, [hidden_dim], bias=True)
        self.linear_fc2 = RowParallelLinear(hidden_dim, dim, bias=True)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, backend: AttentionBackend) -> None:
        super().__init__()
        assert config.intermediate_size is not None
        self.norm1 = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.attn = VisionAttention(config.embed_dim, config.num_heads, backend)
        self.mlp = VisionMLP(config.embed_dim, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


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


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (stride == kernel, with a bias) over one flattened patch (channel,
    temporal, row, col order, as the processor lays it out) is a matmul: stored as a Linear of
    [embed_dim, patch_dim]."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.proj = Linear(config.patch_dim, config.embed_dim, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))


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
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(num_positions, config.embed_dim)
        self.grid_side = int(num_positions**0.5)
        self.rotary = VisionRotary(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList([VisionBlock(config, backend) for _ in range(config.depth)])
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
        positions, sizes = patch_grid_positions(grid_thw, self.config.spatial_merge_size)
        indices, weights = bilinear_taps(positions, sizes, self.grid_side)
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
