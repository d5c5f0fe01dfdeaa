"""Weights reordered once for oneDNN (models/prepack.py): on a bf16 CPU model every Linear layer of
the vision tower runs oneDNN's product on the reordered weight, with the outputs of the plain
weight bit for bit; the decoder's layers (but a tied lm_head) run on the same layout, vlmserve's
kernel for few rows, no further from float32 than the plain weights; VLMSERVE_PREPACK=0 and a
forced AVX2/AVX-512 path keep the plain weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.model_harness import Harness
from tests.models.test_qwen2_vl import _two_image_prompt
from vlmserve.kernels.dispatch import available_paths, avx512_kernels
from vlmserve.kernels.onednn import packed_linear, prepack_available, prepacked_linear
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


def _decoder(model: torch.nn.Module) -> list[Linear]:
    tower = {id(m) for m in model.visual.modules()}
    return [m for m in _linears(model) if id(m) not in tower]


def test_vision_tower_and_decoder_prepacked(
    tiny_dir: Path, images: dict[str, Image.Image], monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt, _ = _two_image_prompt(tiny_dir, images)
    packed = Harness(tiny_dir, torch.bfloat16)
    model = packed.model
    tower = _linears(model.visual)
    assert tower and all(m.weight.is_mkldnn and m.op is prepacked_linear for m in tower)
    assert prepacked_layers(model) == len(tower)
    decoder = _decoder(model)
    head = model.lm_head
    assert head in decoder and head.weight is model.model.embed_tokens.weight  # tied
    if avx512_kernels() is None:
        pytest.skip("no AVX-512 BF16 kernels: the decoder keeps plain weights (test_a_forced_kernel_path...)")
    # every decoder layer on the reordered layout but the tied lm_head, whose rows the embedding reads
    assert not head.weight.is_mkldnn
    rest = [m for m in decoder if m is not head]
    assert rest and all(m.weight.is_mkldnn and m.op is packed_linear for m in rest)
    assert prepacked_layers(model, packed_linear) == len(rest)
    assert bound_linear_op(model) is head.op  # what the banner describes beside the prepacked layers

    monkeypatch.setenv("VLMSERVE_PREPACK", "0")
    plain = Harness(tiny_dir, torch.bfloat16)
    assert prepacked_layers(plain.model) == 0 and prepacked_layers(plain.model, packed_linear) == 0
    with torch.inference_mode():
        ours, theirs = model.embed_multimodal(prompt.mm_items), plain.model.embed_multimodal(prompt.mm_items)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b)  # the vision tower: oneDNN on either layout, bit for bit
    # The decoder sums in another order (vdpbf16ps over pairs of k): no further from the float32
    # logits than the plain weights' kernels are, prefill and decode steps alike.
    extra = [151643, 9707, 11, 1879]
    ref = Harness(tiny_dir, torch.float32).logits(prompt, extra=extra)
    ours, theirs = packed.logits(prompt, extra=extra).float(), plain.logits(prompt, extra=extra).float()
    error, plain_error = (ours - ref).abs(), (theirs - ref).abs()
    assert error.mean() <= 1.25 * plain_error.mean() and error.max() <= 1.5 * plain_error.max()
    assert (ours[-5:].argmax(-1) == ref[-5:].argmax(-1)).all()


def test_untied_lm_head_prepacked(tiny_untied_dir: Path) -> None:
    if avx512_kernels() is None:
        pytest.skip("no AVX-512 BF16 kernels")
    model = Harness(tiny_untied_dir, torch.bfloat16).model
    assert model.lm_head.weight.is_mkldnn and model.lm_head.op is packed_linear
    assert bound_linear_op(model) is None  # every layer prepacked: nothing measured for the dispatch


def test_qwen_vl_names_its_vision_tower(tiny_qwen_vl_dir: Path) -> None:
    model = Harness(tiny_qwen_vl_dir, torch.bfloat16).model
    tower = model.transformer.visual
    assert model.vision_encoder() is tower
    assert prepacked_layers(model) == len(_linears(tower)) > 0


def test_float32_keeps_plain_weights(tiny_dir: Path) -> None:
    assert not any(m.weight.is_mkldnn for m in _linears(Harness(tiny_dir, torch.float32).model))


@pytest.mark.parametrize("path", ["avx512", "avx2"])
def test_a_forced_kernel_path_keeps_plain_weights(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    if path not in available_paths():
        pytest.skip(f"the {path} kernels do not build on this CPU")
    monkeypatch.setenv("VLMSERVE_CPU_PATH", path)
    model = Harness(tiny_dir, torch.bfloat16).model
    assert prepacked_layers(model) == 0 and prepacked_layers(model, packed_linear) == 0
    assert not any(m.weight.is_mkldnn for m in _linears(model))


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu"])
def test_vision_mlp_fuses_its_gelu_into_fc1_unless_an_adapter_hooks_fc1(act: str) -> None:
    """Qwen3-VL's tower MLP on reordered weights: fc1's GELU is oneDNN's post-op (one pass, one
    rounding), within a bf16 step of the separate pass; with a forward hook on fc1 (a LoRA
    adapter's update, which must come before the activation) the two passes run as before."""
    from vlmserve.families.common.vision import VisionMLP

    g = torch.Generator().manual_seed(3)
    mlp = VisionMLP(64, 256, act, names=("linear_fc1", "linear_fc2")).bfloat16().requires_grad_(False)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(300, 64, generator=g).bfloat16()
    fc1 = mlp.linear_fc1
    plain = (fc1.weight.detach().clone(), fc1.bias.detach().clone())
    exact = mlp.act(F.linear(x.float(), plain[0].float(), plain[1].float()))  # float32 throughout
    assert prepack_linear_layers(mlp) == 2
    with torch.inference_mode():
        fused_hidden = fc1.forward_activated(x, act)
        assert fused_hidden is not None
        separate = mlp.act(fc1(x))
        # one rounding instead of two: at least as close to float32, and within a bf16 step of the two-pass result
        assert (fused_hidden.float() - exact).abs().max() <= (separate.float() - exact).abs().max()
        torch.testing.assert_close(fused_hidden, separate, atol=2e-2, rtol=1.6e-2)
        out = mlp(x)
        torch.testing.assert_close(out, mlp.linear_fc2(fused_hidden), atol=0, rtol=0)
        shift = torch.full((256,), 0.5, dtype=torch.bfloat16)
        handle = fc1.register_forward_hook(lambda _m, _i, y: y + shift)
        try:
            assert fc1.forward_activated(x, act) is None
            hooked = mlp(x)
        finally:
            handle.remove()
        torch.testing.assert_close(hooked, mlp.linear_fc2(mlp.act(fc1(x) + shift)), atol=0, rtol=0)
    assert fc1.forward_activated(x, "quick_gelu") is None  # not one oneDNN applies
