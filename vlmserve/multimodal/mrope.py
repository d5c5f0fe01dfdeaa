"""M-RoPE position ids (seed 001): three position streams (temporal, height, width).

Text tokens advance all three together. An image's placeholder tokens sit on its merged patch
grid: with the grid (t, h, w) and merge size m, a token at grid cell (ti, hi, wi) gets
(start + ti, start + hi, start + wi). Text after the image resumes at start + max(h, w) / m.

Worked example: "a b <image 1x4x4, m=2> c" (the image is 2 x 2 merged tokens)

    tokens    a  b  I  I  I  I  c
    temporal  0  1  2  2  2  2  4
    height    0  1  2  2  3  3  4
    width     0  1  2  3  2  3  4

so the sequence has 7 tokens but its last position is 4: mrope_delta = 4 + 1 - 7 = -2, and a
decoded token with index i sits at i + mrope_delta in all three streams.
"""

from __future__ import annotations

import torch

from vlmserve.multimodal.inputs import MultiModalItem


def mrope_positions(num_tokens: int, items: list[MultiModalItem], spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] (int64) and mrope_delta for a prompt whose multimodal
    placeholders are `items` (sorted by offset, not overlapping)."""
    pieces: list[torch.Tensor] = []
    cursor = 0  # next token index
    pos = 0  # next text position
    for item in items:
        if item.offset < cursor:
            raise ValueError("multimodal items overlap or are not sorted by offset")
        if item.offset > cursor:
            text_len = item.offset - cursor
            pieces.append(torch.arange(pos, pos + text_len).expand(3, -1))
            pos += text_len
        t, h, w = item.grid_thw
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if t * gh * gw != item.length:
            raise ValueError(f"item grid {item.grid_thw} gives {t * gh * gw} tokens, placeholder has {item.length}")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(gh, gw)
        cursor = item.end
    if cursor < num_tokens:
        pieces.append(torch.arange(pos, pos + num_tokens - cursor).expand(3, -1))
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    assert positions.shape == (3, num_tokens)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions.contiguous(), delta
