"""M-RoPE positions against transformers' get_rope_index."""

from __future__ import annotations

import random

import torch

from vlmserve.multimodal.inputs import MultiModalItem
from vlmserve.multimodal.mrope import mrope_positions

IMAGE = 151655


def _item(offset: int, grid: tuple[int, int, int]) -> MultiModalItem:
    t, h, w = grid
    return MultiModalItem("image", offset, t * h * w // 4, grid, "h", torch.zeros(0), (0, 0), (0, 0))


def test_worked_example() -> None:
    positions, delta = mrope_positions(7, [_item(2, (1, 4, 4))], 2)
    assert positions.tolist() == [[0, 1, 2, 2, 2, 2, 4], [0, 1, 2, 2, 3, 3, 4], [0, 1, 2, 3, 2, 3, 4]]
    assert delta == -2


def test_text_only_is_plain_rope() -> None:
    positions, delta = mrope_positions(5, [], 2)
    assert positions.tolist() == [list(range(5))] * 3
    assert delta == 0


def test_matches_transformers_on_random_layouts(hf_model) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(0)
    for _ in range(20):
        ids: list[int] = []
        items = []
        for k in range(rng.randint(1, 4)):
            # Images are always separated by text (<|vision_end|><|vision_start|> at least).
            ids.extend(rng.randint(0, 1000) for _ in range(rng.randint(0 if k == 0 else 1, 5)))
            grid = (1, 2 * rng.randint(1, 6), 2 * rng.randint(1, 6))
            items.append(_item(len(ids), grid))
            ids.extend([IMAGE] * items[-1].length)
        ids.extend(rng.randint(0, 1000) for _ in range(rng.randint(0, 5)))
        ours, delta = mrope_positions(len(ids), items, 2)
        input_ids = torch.tensor([ids])
        grids = torch.tensor([item.grid_thw for item in items])
        theirs, their_delta = hf_model.model.get_rope_index(input_ids, (input_ids == IMAGE).int(), grids)
        assert torch.equal(ours, theirs[:, 0])
        assert delta == int(their_delta)
