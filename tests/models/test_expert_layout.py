"""Stacked expert weights read either way round (vlmserve/models/expert_layout.py), driven with
hand-built tensors and a two-parameter module; tests/models/test_qwen3_vl.py loads whole
Qwen3-VL-MoE checkpoints stored both ways."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vlmserve.models.expert_layout import CheckpointExpertLayouts, ExpertLayout, layout_written_by
from vlmserve.models.loader import WeightTable, load_weights

OUT_IN = ExpertLayout.OUT_IN
IN_OUT = ExpertLayout.IN_OUT


def test_a_shape_that_differs_when_transposed_tells_its_layout() -> None:
    layouts = CheckpointExpertLayouts(None)
    assert layouts.layout_of("a", torch.empty(4, 6, 5), (4, 6, 5)) is OUT_IN
    assert layouts.layout_of("b", torch.empty(4, 5, 6), (4, 6, 5)) is IN_OUT
    assert layouts.layout_of("c", torch.empty(4, 5, 5), (4, 5, 5)) is None
    assert layouts.seen == {OUT_IN: "a", IN_OUT: "b"}


def test_a_shape_of_neither_layout_is_refused_with_both_expected() -> None:
    with pytest.raises(ValueError) as error:
        CheckpointExpertLayouts(None).layout_of("x.down_proj", torch.empty(4, 6, 7), (4, 6, 5))
    assert str(error.value) == (
        "weight x.down_proj: checkpoint shape (4, 6, 7), model expects (4, 6, 5) [experts, out, in] "
        "or (4, 5, 6) [experts, in, out]"
    )


@pytest.mark.parametrize("seen", [OUT_IN, IN_OUT])
def test_a_square_tensor_takes_the_layout_of_the_others_before_the_version(seen: ExpertLayout) -> None:
    layouts = CheckpointExpertLayouts("4.57.0" if seen is OUT_IN else "5.24.0")  # the version disagrees
    layouts.layout_of("down", torch.empty(4, 6, 5) if seen is OUT_IN else torch.empty(4, 5, 6), (4, 6, 5))
    assert layouts.resolve("gate_up", torch.empty(4, 5, 5)) is seen


def test_without_other_evidence_config_json_s_transformers_version_tells() -> None:
    assert CheckpointExpertLayouts("4.57.0.dev0").resolve("gate_up", torch.empty(2, 3, 3)) is IN_OUT
    assert CheckpointExpertLayouts("5.24.0").resolve("gate_up", torch.empty(2, 3, 3)) is OUT_IN
    assert layout_written_by("5.0.0") is OUT_IN and layout_written_by("4.57.1") is IN_OUT
    assert layout_written_by(None) is None and layout_written_by("main") is None


def test_a_square_tensor_nothing_tells_is_refused_naming_it() -> None:
    with pytest.raises(ValueError) as error:
        CheckpointExpertLayouts(None).resolve("layers.0.mlp.experts.gate_up_proj", torch.empty(2, 3, 3))
    assert str(error.value) == (
        "weight layers.0.mlp.experts.gate_up_proj: checkpoint shape (2, 3, 3) fits both (2, 3, 3) [experts, out, in] "
        "(transformers 5's save_pretrained) and (2, 3, 3) [experts, in, out] (transformers 4.x, the published "
        "checkpoints), as its in and out sizes are equal; it has no other stacked expert tensor whose shape "
        'tells, and config.json has no transformers_version. Set "transformers_version" in config.json to the '
        "release that wrote the checkpoint (4.x: [experts, in, out], 5.x: [experts, out, in])"
    )
    mixed = CheckpointExpertLayouts("dev")
    mixed.layout_of("a", torch.empty(2, 4, 3), (2, 4, 3))
    mixed.layout_of("b", torch.empty(2, 3, 4), (2, 4, 3))
    with pytest.raises(ValueError, match=r"stored both ways \(a as \[experts, out, in\], b as \[experts, in, out\]\)"):
        mixed.resolve("c", torch.empty(2, 3, 3))
    with pytest.raises(ValueError, match="transformers_version 'dev' is not a release number"):
        mixed.resolve("c", torch.empty(2, 3, 3))


class Experts(nn.Module):
    """A SwiGLU expert stack whose gate_up_proj is square (hidden 4 == 2 * intermediate 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(3, 4, 4))  # [experts, 2 * intermediate, hidden]
        self.down_proj = nn.Parameter(torch.zeros(3, 4, 2))  # [experts, hidden, intermediate]


TABLE = WeightTable(either_layout=frozenset({"gate_up_proj", "down_proj"}))


@pytest.mark.parametrize("layout", [OUT_IN, IN_OUT])
def test_the_loader_orients_a_square_tensor_read_before_the_tensor_that_tells(layout: ExpertLayout) -> None:
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(3, 4, 4, generator=g), torch.randn(3, 4, 2, generator=g)  # [experts, out, in]
    stored = (lambda t: t) if layout is OUT_IN else (lambda t: t.transpose(1, 2).contiguous())
    model = Experts()
    load_weights(model, [("gate_up_proj", stored(gate_up)), ("down_proj", stored(down))], TABLE)
    assert not torch.equal(gate_up, gate_up.transpose(1, 2))  # the wrong way round would show
    assert torch.equal(model.gate_up_proj.data, gate_up) and torch.equal(model.down_proj.data, down)


def test_the_loader_refuses_a_square_tensor_nothing_tells() -> None:
    with pytest.raises(ValueError, match=r"weight gate_up_proj: checkpoint shape \(3, 4, 4\) fits both"):
        load_weights(Experts(), [("gate_up_proj", torch.zeros(3, 4, 4))], TABLE)


def test_the_loader_believes_the_shapes_over_the_version() -> None:
    model = Experts()
    square = torch.arange(48.0).reshape(3, 4, 4)
    load_weights(
        model,
        [("gate_up_proj", square), ("down_proj", torch.zeros(3, 4, 2))],
        WeightTable(either_layout=TABLE.either_layout, transformers_version="4.57.0"),
    )
    # down_proj [3, 4, 2] is [experts, out, in] whatever 4.57 would have written
    assert torch.equal(model.gate_up_proj.data, square)
