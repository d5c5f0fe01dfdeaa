"""M-RoPE position ids (seeds 001 and 002): three position streams (temporal, height, width).

Text tokens advance all three together. An image's placeholder tokens sit on its merged patch
grid: with the grid (t, h, w) and merge size m, a token at grid cell (ti, hi, wi) gets
(start + ti, start + hi, start + wi). Text after an item resumes one past the item's largest
position.

Worked example: "a b <image 1x4x4, m=2> c" (the image is 2 x 2 merged tokens)

    tokens    a  b  I  I  I  I  c
    temporal  0  1  2  2  2  2  4
    height    0  1  2  2  3  3  4
    width     0  1  2  3  2  3  4

so the sequence has 7 tokens but its last position is 4: mrope_delta = 4 + 1 - 7 = -2, and a
decoded token with index i sits at i + mrope_delta in all three streams.

Qwen2.5-VL gives videos absolute time: temporal index ti becomes
start + int(ti * second_per_grid_t * tokens_per_second). With tokens_per_second 25 and 0.5 s per
temporal patch, a 3-patch video's temporal positions are start + [0, 12, 25], and the text after
it resumes at start + 26 when the spatial grid is smaller than that.

transformers 5.x resumes text at start + max(h, w) / m whatever the temporal extent, so a video
whose temporal positions reach further overlaps the text after it; the original Qwen release, the
seed and vLLM resume one past the largest position, as here. The two agree for images and for any
video whose temporal positions stay below max(h, w) / m.
"""

from __future__ import annotations

import torch

from vlmserve.multimodal.inputs import MultiModalItem


def item_positions(
    item: MultiModalItem, start: int, spatial_merge_size: int, tokens_per_second: float | None
) -> torch.Tensor:
    """[3, item.length] positions of one item's placeholder tokens, which begin at position `start`."""
    t, h, w = item.grid_thw
    gh, gw = h // spatial_merge_size, w // spatial_merge_size
    if t * gh * gw != item.length:
        raise ValueError(f"item grid {item.grid_thw} gives {t * gh * gw} tokens, placeholder has {item.length}")
    temporal = torch.arange(t)
    if item.modality == "video" and tokens_per_second is not None:
        if item.second_per_grid_t is None:
            raise ValueError("a video item needs second_per_grid_t for absolute-time positions")
        # float32 like the reference, quantised after the multiplication by the grid index.
        interval = torch.tensor(item.second_per_grid_t, dtype=torch.float32) * tokens_per_second
        temporal = (temporal * interval).long()
    tt, hh, ww = torch.meshgrid(temporal, torch.arange(gh), torch.arange(gw), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_positions(
    num_tokens: int, items: list[MultiModalItem], spatial_merge_size: int, tokens_per_second: float | None = None
) -> tuple[torch.Tensor, int]:
    """Positions [3, num_tokens] (int64) and mrope_delta for a prompt whose multimodal
    placeholders are `items` (sorted by offset, not overlapping). `tokens_per_second` is the
    vision config's (Qwen2.5-VL); None spaces video frames by one position (Qwen2-VL)."""
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
        pieces.append(item_positions(item, pos, spatial_merge_size, tokens_per_second))
        pos = int(pieces[-1].max()) + 1
        cursor = item.end
    if cursor < num_tokens:
        pieces.append(torch.arange(pos, pos + num_tokens - cursor).expand(3, -1))
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    assert positions.shape == (3, num_tokens)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions.contiguous(), delta
