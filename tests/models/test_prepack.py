"""The vision towers' weights reordered once for oneDNN (models/prepack.py): on a bf16 CPU model
every Linear layer of the vision tower, and only those, runs on the reordered weight, with the
outputs of the plain weight bit for bit; VLMSERVE_PREPACK=0 and a forced AVX2/AVX-512 path keep
the plain weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.model_harness import Harness
from tests.models.test_qwen2_vl import _two_image_prompt
from vlmserve.kernels.dispatch import available_paths
from vlmserve.kernels.onednn import prepack_available, prepacked_linear
from vlmserve.models.layers import Linear, bound_linear_op
from vlmserve.models.prepack import prepack_linear_layers, prepacked_layers

pytestmark = pytest.mark.skipif(not prepack_available(), reason="this torch lacks oneDNN's bf16 weight reorder")


def _linears(module: torch.nn.Module) -> list[Linear]:
    return [m for m in module.modules() if isinstance(m, Linear)]


@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(1, 64, 80), (7, 33, 37), (300, 96, 1176)])
def test_prepacked_product_equals_f_linear(rows: int, out_features: int, in_features: int) -> None:
    g = torch.Generator().manual_seed(rows)
    layer = Linear(in_features, out_features, bias=True).bfloat16().requires_grad_(False)  # as build_model leaves it
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=g))
        layer.bias.copy_(torch.randn(out_features, generator=g))
    plain_weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    x = torch.randn(2, rows, in_features, generator=g).bfloat16()
    assert prepack_linear_layers(layer) == 1
    assert layer.weight.is_mkldnn and layer.weight.shape == plain_weight.shape and layer.op is prepacked_linear
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, plain_weight, bias))
    assert prepack_linear_layers(layer) == 0  # already reordered: left as it is


def test_vision_tower_prepacked_with_identical_logits(
    tiny_dir: Path, images: dict[str, Image.Image], monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt, _ = _two_image_prompt(tiny_dir, images)
    packed = Harness(tiny_dir, torch.bfloat16)
    tower = _linears(packed.model.visual)
    assert tower and all(m.weight.is_mkldnn and m.op is prepacked_linear for m in tower)
    assert prepacked_layers(packed.model) == len(tower)
    rest = [m for m in _linears(packed.model) if m not in tower]
    assert rest and not any(m.weight.is_mkldnn for m in rest)
    assert bound_linear_op(packed.model) is rest[0].op  # what the banner describes: the decoder's op

    monkeypatch.setenv("VLMSERVE_PREPACK", "0")
    plain = Harness(tiny_dir, torch.bfloat16)
    assert prepacked_layers(plain.model) == 0
    assert torch.equal(packed.logits(prompt), plain.logits(prompt))


def test_qwen_vl_names_its_vision_tower(tiny_qwen_vl_dir: Path) -> None:
    model = Harness(tiny_qwen_vl_dir, torch.bfloat16).model
    tower = model.transformer.visual
    assert model.vision_encoder() is tower
    assert prepacked_layers(model) == len(_linears(tower)) > 0


def test_float32_keeps_plain_weights(tiny_dir: Path) -> None:
    assert prepacked_layers(Harness(tiny_dir, torch.float32).model) == 0


@pytest.mark.parametrize("path", ["avx512", "avx2"])
def test_a_forced_kernel_path_keeps_plain_weights(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    if path not in available_paths():
        pytest.skip(f"the {path} kernels do not build on this CPU")
    monkeypatch.setenv("VLMSERVE_CPU_PATH", path)
    assert prepacked_layers(Harness(tiny_dir, torch.bfloat16).model) == 0
