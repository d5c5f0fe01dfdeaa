"""AWQ and GPTQ checkpoints as published: known integer weights packed here in each layout (the
packers below follow the formats' documentation, independently of vlmserve's unpacking), the
dequantized matrices checked exactly, and tiny checkpoints written in each layout giving the same
logits as a float checkpoint holding the dequantized weights."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.kernels.test_int4 import needs_kernel as needs_int4
from tests.model_harness import Harness
from vlmserve import LLM, SamplingParams
from vlmserve.kernels.int4 import load_int4_kernel
from vlmserve.model_files import iterate_weights, safetensors_files
from vlmserve.models.quant import read_packed_config, resolve_quantization
from vlmserve.models.quant.int4 import Int4Linear
from vlmserve.models.quant.packed import PackedConfig, dequantize, dequantize_weights, unpack_awq
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.tools.quantize_awq import pack_awq, quantize_checkpoint, quantize_rtn

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM pack order: nibble i holds column 8j + AWQ_ORDER[i]


def _to_int32(packed: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(packed.astype(np.uint32).view(np.int32).copy())


def pack_awq_columns(values: torch.Tensor) -> torch.Tensor:
    """[R, C] ints 0..15 -> [R, C / 8] int32, AutoAWQ's interleaved column order."""
    v = values.numpy().astype(np.uint64)
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint64)
    for j in range(v.shape[1] // 8):
        for i in range(8):
            out[:, j] |= v[:, 8 * j + AWQ_ORDER[i]] << np.uint64(4 * i)
    return _to_int32(out)


def pack_gptq_rows(values: torch.Tensor) -> torch.Tensor:
    """[K, N] ints 0..15 -> [K / 8, N] int32: bits 4i.. of row r hold row 8r + i."""
    v = values.numpy().astype(np.uint64)
    out = np.zeros((v.shape[0] // 8, v.shape[1]), dtype=np.uint64)
    for r in range(v.shape[0] // 8):
        for i in range(8):
            out[r] |= v[8 * r + i] << np.uint64(4 * i)
    return _to_int32(out)


def pack_gptq_columns(values: torch.Tensor) -> torch.Tensor:
    """[G, N] ints 0..15 -> [G, N / 8] int32, plain order."""
    v = values.numpy().astype(np.uint64)
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint64)
    for j in range(v.shape[1] // 8):
        for i in range(8):
            out[:, j] |= v[:, 8 * j + i] << np.uint64(4 * i)
    return _to_int32(out)


def quantized_layer(
    method: str, n: int, k: int, group: int, seed: int, *, desc_act: bool = False, sym: bool = False
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random 4-bit weights of an [n, k] linear in `method`'s published layout, and the float32
    weight [n, k] they stand for: w[n, k] = (w_int[k, n] - zero[g(k), n]) * scale[g(k), n]."""
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    w_int = torch.randint(0, 16, (k, n), generator=g)
    zeros = (
        torch.full((groups, n), 8) if sym else torch.randint(1 if method == "gptq" else 0, 16, (groups, n), generator=g)
    )
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.005).half()
    g_idx = torch.arange(k) // group
    if desc_act:
        g_idx = g_idx[torch.randperm(k, generator=g)]  # rows quantized out of order: groups scattered
    weight = ((w_int - zeros[g_idx]).float() * scales.float()[g_idx]).t().contiguous()
    if method == "awq":
        parts = {"qweight": pack_awq_columns(w_int), "qzeros": pack_awq_columns(zeros), "scales": scales}
    else:
        parts = {
            "qweight": pack_gptq_rows(w_int),
            "qzeros": pack_gptq_columns(zeros - 1),  # GPTQ v1 stores zero - 1
            "scales": scales,
            "g_idx": g_idx.to(torch.int32),
        }
    return parts, weight


@pytest.mark.parametrize(
    ("method", "desc_act", "sym"),
    [("awq", False, False), ("gptq", False, False), ("gptq", True, False), ("gptq", False, True)],
)
def test_dequantized_matrix_is_exact(method: str, desc_act: bool, sym: bool) -> None:
    parts, weight = quantized_layer(method, n=48, k=256, group=128, seed=3, desc_act=desc_act, sym=sym)
    config = PackedConfig(method, 128, desc_act, 1 if method == "gptq" else 0)
    assert torch.equal(dequantize(config, parts, "layer"), weight)


def test_awq_pack_order_is_interleaved() -> None:
    # column c of a pack of 8 holds value c: AWQ puts columns 0, 2, 4, 6, 1, 3, 5, 7 in nibbles 0..7
    packed = pack_awq_columns(torch.arange(8)[None, :])
    assert packed.item() == 0x75316420
    w, z = unpack_awq(packed, packed)
    assert w.tolist() == z.tolist() == [list(range(8))]


def test_stream_turns_packed_modules_into_weights_and_passes_the_rest() -> None:
    parts, weight = quantized_layer("gptq", n=16, k=32, group=16, seed=4)
    stream = [
        ("a.bias", torch.ones(16)),
        *((f"a.{k}", v) for k, v in sorted(parts.items())),
        ("b.weight", torch.zeros(2)),
    ]
    out = dict(dequantize_weights(stream, PackedConfig("gptq", 16, False, 1)))
    assert set(out) == {"a.bias", "a.weight", "b.weight"}
    assert torch.equal(out["a.weight"], weight)
    with pytest.raises(ValueError, match=r"a: the checkpoint holds only \['qweight'\]"):
        list(dequantize_weights([("a.qweight", parts["qweight"])], PackedConfig("gptq", 16, False, 1)))


DECODER_LINEAR = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def write_packed_checkpoint(
    src: Path, out: Path, method: str, group: int, *, desc_act: bool = False, sym: bool = False
) -> tuple[Path, Path]:
    """The tiny checkpoint with its decoder linears in `method`'s layout (random 4-bit weights),
    and a float32 checkpoint holding exactly the weights those dequantize to."""
    packed_dir, float_dir = out / f"{method}", out / f"{method}-float"
    packed: dict[str, torch.Tensor] = {}
    floats: dict[str, torch.Tensor] = {}
    for i, (name, tensor) in enumerate(iterate_weights(src)):
        if DECODER_LINEAR.search(name):
            n, k = tensor.shape
            parts, weight = quantized_layer(method, n, k, group, seed=i, desc_act=desc_act, sym=sym)
            module = name.removesuffix(".weight")
            packed.update({f"{module}.{suffix}": t for suffix, t in parts.items()})
            floats[name] = weight
        else:
            packed[name] = floats[name] = tensor.float() if tensor.is_floating_point() else tensor
    config = json.loads((src / "config.json").read_text())
    weight_files = {f.name for f in safetensors_files(src)} | {"model.safetensors.index.json"}
    for target, weights, quant in (
        (packed_dir, packed, True),
        (float_dir, floats, False),
    ):
        target.mkdir(parents=True)
        for f in src.iterdir():
            if f.is_file() and f.name not in weight_files and f.name != "config.json":
                shutil.copy(f, target / f.name)
        c = dict(config)
        if quant:
            c["quantization_config"] = (
                {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
                if method == "awq"
                else {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act, "sym": sym}
            )
        (target / "config.json").write_text(json.dumps(c))
        save_file({k: v.contiguous() for k, v in weights.items()}, str(target / "model.safetensors"))
    return packed_dir, float_dir


@pytest.mark.parametrize(
    ("method", "desc_act", "sym"), [("awq", False, False), ("gptq", True, False), ("gptq", False, True)]
)
def test_packed_checkpoint_runs_as_the_float_model_of_its_dequantized_weights(
    tiny_dir: Path, tmp_path: Path, method: str, desc_act: bool, sym: bool, cpu_path: Callable[[str | None], None]
) -> None:
    # The tiny model's linears have 64 or 128 inputs: groups of 32 (published: 128) give several.
    packed_dir, float_dir = write_packed_checkpoint(tiny_dir, tmp_path, method, 32, desc_act=desc_act, sym=sym)
    # Every product on the float weights dequantized from the 4-bit ones, exactly: dequantized as
    # they load (desc_act), or kept 4-bit and dequantized per call (the torch path).
    cpu_path("torch")
    ours = Harness(packed_dir, torch.float32, num_blocks=8)
    assert any(isinstance(m, Int4Linear) for m in ours.model.modules()) != desc_act
    reference = Harness(float_dir, torch.float32, num_blocks=8)
    prompt = _prompt(tiny_dir)
    assert torch.equal(ours.logits(prompt, extra=[9707, 11]), reference.logits(prompt, extra=[9707, 11]))


def _prompt(model_dir: Path) -> ProcessedPrompt:
    from tests.processor.test_qwen2_vl import make_processor

    return make_processor(model_dir).process("<|im_start|>user\nWhat is in the harbour?<|im_end|>\n", [])


@pytest.fixture
def cpu_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str | None], None]]:
    """Sets VLMSERVE_CPU_PATH (None: unset) for the models built after it."""

    def choose(path: str | None) -> None:
        if path is None:
            monkeypatch.delenv("VLMSERVE_CPU_PATH", raising=False)
        else:
            monkeypatch.setenv("VLMSERVE_CPU_PATH", path)
        load_int4_kernel.cache_clear()

    yield choose
    monkeypatch.delenv("VLMSERVE_CPU_PATH", raising=False)
    load_int4_kernel.cache_clear()


@needs_int4
@pytest.mark.parametrize("path", [None, "avx2"])
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_kernels_compute_the_float_model_of_the_dequantized_weights(
    tiny_dir: Path, tmp_path: Path, method: str, path: str | None, cpu_path: Callable[[str | None], None]
) -> None:
    packed_dir, float_dir = write_packed_checkpoint(tiny_dir, tmp_path, method, 32)
    cpu_path(path)
    ours = Harness(packed_dir, torch.float32, num_blocks=8)
    int4 = [name for name, m in ours.model.named_modules() if isinstance(m, Int4Linear)]
    assert len(int4) == 2 * 4 and all(".layers." in name for name in int4)  # qkv, o, gate_up, down of 2 layers
    reference = Harness(float_dir, torch.float32, num_blocks=8)
    prompt = _prompt(tiny_dir)
    extra = [9707, 11, 1879, 13]  # decode steps: the kernels with one row
    error = (ours.logits(prompt, extra=extra) - reference.logits(prompt, extra=extra)).abs().max().item()
    assert error < 1e-4  # fp32 summation order only (measured 1.2e-5 and 1.3e-5)


@needs_int4
def test_int4_kernels_in_bf16_stay_as_close_to_float32_as_the_float_model(
    tiny_dir: Path, tmp_path: Path, cpu_path: Callable[[str | None], None]
) -> None:
    packed_dir, float_dir = write_packed_checkpoint(tiny_dir, tmp_path, "awq", 32)
    cpu_path(None)
    prompt, extra = _prompt(tiny_dir), [9707, 11, 1879, 13]
    exact = Harness(float_dir, torch.float32, num_blocks=8).logits(prompt, extra=extra)
    ours = Harness(packed_dir, torch.bfloat16, num_blocks=8)
    assert any(isinstance(m, Int4Linear) for m in ours.model.modules())
    error = (ours.logits(prompt, extra=extra).float() - exact).abs()
    float_bf16 = (Harness(float_dir, torch.bfloat16, num_blocks=8).logits(prompt, extra=extra).float() - exact).abs()
    print(
        f"\nbf16 against fp32, mean / max: int4 kernels {error.mean():.4f} / {error.max():.4f}, float weights "
        f"{float_bf16.mean():.4f} / {float_bf16.max():.4f}"
    )
    # the kernels keep each weight exact and sum in fp32; the float model rounds its weights to bf16
    assert error.mean().item() <= 1.5 * float_bf16.mean().item()
    assert error.max().item() <= 1.5 * float_bf16.max().item()


def test_qwen3_vl_awq_checkpoint_loads_and_generates(tiny3_dir: Path, tmp_path: Path) -> None:
    packed_dir, float_dir = write_packed_checkpoint(tiny3_dir, tmp_path, "awq", 32)
    greedy = {}
    for d in (packed_dir, float_dir):
        llm = LLM(d, dtype="float32", max_model_len=128, kv_cache_memory_gib=0.01)
        greedy[d] = (
            llm.generate("Name a colour.", SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0].token_ids
        )
    assert greedy[packed_dir] == greedy[float_dir]


def test_quantization_settings_are_checked(tmp_path: Path) -> None:
    def config_with(q: dict[str, object]) -> Path:
        p = tmp_path / "config.json"
        p.write_text(json.dumps({"quantization_config": q}))
        return p

    assert read_packed_config(config_with({"quant_method": "awq", "bits": 4, "group_size": 128})) == PackedConfig(
        "awq", 128
    )
    assert read_packed_config(
        config_with(
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "checkpoint_format": "gptq_v2"}
        )
    ) == PackedConfig("gptq", 128, True, 0)
    with pytest.raises(ValueError, match="bits=8; only 4-bit"):
        read_packed_config(config_with({"quant_method": "gptq", "bits": 8}))
    with pytest.raises(ValueError, match="'fp8' is not supported"):
        read_packed_config(config_with({"quant_method": "fp8"}))
    with pytest.raises(ValueError, match="version 'gemv'"):
        read_packed_config(config_with({"quant_method": "awq", "bits": 4, "version": "gemv"}))
    awq = PackedConfig("awq", 128)
    assert resolve_quantization(None, awq) == "awq" and resolve_quantization(None, None) is None
    assert resolve_quantization("int8", None) == "int8"
    with pytest.raises(ValueError, match="quantized with awq.*'int8' does not apply"):
        resolve_quantization("int8", awq)
    with pytest.raises(ValueError, match="'gptq' needs a checkpoint quantized with it"):
        resolve_quantization("gptq", None)
    with pytest.raises(ValueError, match="'int4' is not supported"):
        resolve_quantization("int4", None)


# -- 4-bit accuracy against the float model (round-to-nearest into AWQ's layout) ---------------------


def test_the_rtn_tool_packs_as_autoawq_and_rounds_to_the_nearest_step() -> None:
    values = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(1))
    assert torch.equal(pack_awq(values.to(torch.int32)), pack_awq_columns(values))
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(2))
    q, zeros, scales = quantize_rtn(weight, 64)
    per_input = torch.arange(256) // 64
    back = (q - zeros[per_input]).float() * scales.float()[per_input]  # [K, N]
    assert ((back.t() - weight).abs() <= scales.float()[per_input].t() / 2 + 1e-6).all()


@pytest.mark.slow
@needs_int4
def test_int4_logits_and_greedy_tokens_against_the_float_model(tiny_dir: Path, tmp_path: Path) -> None:
    from tests.models.quant.test_int8 import _agreement, _greedy

    awq_dir = quantize_checkpoint(tiny_dir, tmp_path / "awq", group=32)
    prompt, extra = _prompt(tiny_dir), [9707, 11, 1879, 13]
    reference = Harness(tiny_dir, torch.float32).logits(prompt, extra=extra)
    ours = Harness(awq_dir, torch.float32)
    assert any(isinstance(m, Int4Linear) for m in ours.model.modules())
    error = (ours.logits(prompt, extra=extra) - reference).abs()
    spread = reference.std().item()
    agreement = _agreement(_greedy(tiny_dir, "float32", None), _greedy(awq_dir, "float32", None))
    print(
        f"\nint4 (round-to-nearest, groups of 32) vs float32: logits error mean {error.mean():.4f} max "
        f"{error.max():.4f} (std {spread:.3f}); greedy tokens identical before the first difference: {agreement}"
    )
    # Measured: mean 0.467, max 3.70 (std 2.39), greedy [0, 4, 16, 4]. Sixteen levels per group of
    # random (Gaussian) weights is a step of ~0.27 of their spread: 13x int8's error here (mean
    # 0.028); a random-weight model's top logits lie close together, so greedy tokens part soon.
    assert error.mean().item() < 0.3 * spread
    assert error.max().item() < 2.5 * spread
    assert sum(agreement) >= 12
