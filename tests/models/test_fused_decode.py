"""A decode step's whole decoder in one kernel call (models/fused_decode.py): where it applies
(bf16, AVX-512 kernels, reordered decoder weights, head_dim a multiple of 32), an engine gives the
same tokens and the same log-probabilities bit for bit as one decoding layer by layer
(VLMSERVE_FUSED_DECODE=0), over several sequences of different lengths, one with an image:
Qwen2-VL, Qwen2.5-VL and Qwen3-VL (its per-head q/k norms; DeepStack in the image's prefill); a
verify step (a few tokens per sequence after cached ones) runs fused as decode rows, each row's
bits a decode step's; other steps, and Qwen3-VL-MoE, run layer by layer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlmserve import LLM, SamplingParams
from vlmserve.bench.verify_cost import prefilled_requests, step_hidden
from vlmserve.engine.banner import engine_summary
from vlmserve.engine.step_batch import prepare
from vlmserve.families.qwen2_vl.tiny import QWEN2_5_VL_SPEC, TinySpec, write_tiny_qwen2_vl
from vlmserve.families.qwen3_vl import tiny as qwen3_tiny
from vlmserve.ipc.contracts import SchedulerOutput
from vlmserve.kernels import dispatch
from vlmserve.kernels.dispatch import avx512_kernels
from vlmserve.kernels.onednn import prepack_available
from vlmserve.models.fused_decode import FUSED_ROWS, FusedDecode
from vlmserve.models.quant.int4 import Int4Linear
from vlmserve.tools.quantize_awq import quantize_checkpoint

pytestmark = pytest.mark.skipif(
    avx512_kernels() is None or not prepack_available(), reason="needs the AVX-512 BF16 kernels and oneDNN's reorder"
)

# The tiny checkpoints' decoder widened to shapes the fused kernel takes: head_dim 32 (4 query and
# 2 KV heads over 128), qkv 256, gate_up 384 outputs (multiples of 64).
WIDE = {"hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 3, "mrope_section": (4, 6, 6)}
# Qwen3-VL: the same widths, head_dim 32 explicit, interleaved M-RoPE over its 16 frequencies.
WIDE3 = {**WIDE, "head_dim": 32, "mrope_section": (6, 5, 5)}
PAD = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fused") / request.param
    if request.param == "qwen3_vl":
        return qwen3_tiny.write_tiny_qwen3_vl(out, replace(qwen3_tiny.TinySpec(), **WIDE3), seed=7)
    spec = replace(TinySpec() if request.param == "qwen2_vl" else QWEN2_5_VL_SPEC, **WIDE)
    return write_tiny_qwen2_vl(out, spec, seed=7)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Every FusedDecode call: (rows, whether the fused kernel ran the step)."""
    seen: list[tuple[int, bool]] = []
    fused_call = FusedDecode.__call__

    def spy(self, x, cos, sin, meta):  # type: ignore[no-untyped-def]
        out = fused_call(self, x, cos, sin, meta)
        seen.append((x.shape[0], out is not None))
        return out

    monkeypatch.setattr(FusedDecode, "__call__", spy)
    return seen


def _run(
    checkpoint: Path, image: Image.Image, quantization: str | None
) -> tuple[list[list[int]], list[list[dict[int, float]]], LLM]:
    llm = LLM(
        checkpoint,
        dtype="bfloat16",
        quantization=quantization,
        max_model_len=1024,
        max_num_seqs=8,
        kv_cache_memory_gib=0.02,
    )
    prompts = [
        "Hello",
        "Count from one to twenty, slowly: one, two, three, four, five",
        {"prompt": f"<|im_start|>user\n{PAD}Describe it.<|im_end|>\n<|im_start|>assistant\n",
         "multi_modal_data": {"image": [image]}},
        "A longer prompt " * 12,
    ]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=4)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    tokens = [o.token_ids for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in step.items()} for step in o.logprobs or []] for o in outs]
    return tokens, logprobs, llm


@pytest.mark.slow
@pytest.mark.parametrize("quantization", [None, "int8", "awq"])
def test_fused_decode_gives_the_layer_paths_bits(
    checkpoint: Path,
    images: dict[str, Image.Image],
    monkeypatch: pytest.MonkeyPatch,
    calls: list[tuple[int, bool]],
    quantization: str | None,
    tmp_path: Path,
) -> None:
    if quantization == "awq":  # a 4-bit checkpoint, kept packed: the AVX-512 int4 kernel's products
        checkpoint = quantize_checkpoint(checkpoint, tmp_path / checkpoint.name, group=32)
    # The layers outside the decoder (the tied lm_head) take the dispatch table's path in both
    # engines: a start-up measurement on a loaded machine could pick another kernel in one of them,
    # whose sums in another order would differ in the last bit.
    measure = dispatch.measure
    monkeypatch.setattr(dispatch, "measure", lambda ops, shapes: measure(ops, shapes, budget_s=0.0))
    tokens, logprobs, llm = _run(checkpoint, images["wide"], quantization)
    assert llm.llm_engine.model.model.fused_decode is not None
    int4 = [m for m in llm.llm_engine.model.modules() if isinstance(m, Int4Linear)]
    assert len(int4) == (3 * 4 if quantization == "awq" else 0)
    assert "whole decoder in one call" in engine_summary(llm.llm_engine.core, str(checkpoint))["linear layers"]
    ran = [rows for rows, fused in calls if fused]
    assert ran and max(ran) == 4  # the four sequences decoded together in one call
    # The prompts' step went layer by layer: declined by the fused call, or (Qwen3-VL: the image's
    # DeepStack features ride along) never offered to it.
    assert any(not fused for _, fused in calls) == (checkpoint.name != "qwen3_vl")
    assert len(ran) == 19  # every decode step after the prompts' (20 tokens, the first from the prefill)
    del llm

    calls.clear()
    monkeypatch.setenv("VLMSERVE_FUSED_DECODE", "0")
    plain_tokens, plain_logprobs, plain = _run(checkpoint, images["wide"], quantization)
    assert plain.llm_engine.model.model.fused_decode is None and not calls
    assert "one call" not in engine_summary(plain.llm_engine.core, str(checkpoint))["linear layers"]
    assert tokens == plain_tokens
    assert logprobs == plain_logprobs  # exact floats: the same hidden states bit for bit
    assert all(len(steps) == 20 for steps in logprobs)


def test_a_verify_step_runs_fused_and_gives_each_row_its_decode_steps_bits(
    checkpoint: Path, calls: list[tuple[int, bool]]
) -> None:
    """Three requests computing 5 tokens each after 40 cached (a speculative-decoding verify step:
    15 decode rows, 3 sharing each block table) run in one fused call, and every row's hidden
    state is bit for bit what decoding its tokens one step at a time gives (fused steps of 3
    rows), and what the same verify step gives layer by layer; pruned to the sampled rows, those."""
    llm = LLM(checkpoint, dtype="bfloat16", max_model_len=256, max_num_seqs=4, kv_cache_memory_gib=0.02,
              enable_prefix_caching=False)  # fmt: skip
    states = prefilled_requests(llm, 3, 40, 4, seed=1)
    prompts = {s.request_id: list(s.token_ids) for s in states}
    calls.clear()
    verify = step_hidden(llm, states, prompts, 40, 5)
    assert calls == [(15, True)]
    one_by_one = torch.stack([step_hidden(llm, states, prompts, 40 + j, 1) for j in range(5)], dim=1)
    assert calls[1:] == [(3, True)] * 5
    assert torch.equal(verify, one_by_one.flatten(0, 1))
    # The step as the engine prepares it today, pruned to each request's last row (sampled): fused,
    # those rows' bits.
    engine = llm.llm_engine
    runner, model = engine.runner, engine.model
    step_hidden(llm, states, prompts, 40, 5)
    step = SchedulerOutput(num_scheduled_tokens={s.request_id: 5 for s in states})
    batch = prepare(step, runner.requests, runner.encoder_cache, runner.block_size, model.decode_positions, True)
    assert batch.output_rows == [4, 9, 14]
    calls.clear()
    assert torch.equal(runner.forward(batch, step), verify[[4, 9, 14]])
    assert calls == [(15, True)]
    decoder = llm.llm_engine.model.model
    decoder.fused_decode, fused = None, decoder.fused_decode
    try:
        assert torch.equal(step_hidden(llm, states, prompts, 40, 5), verify)
    finally:
        decoder.fused_decode = fused


def test_a_head_dim_the_kernel_does_not_take_decodes_layer_by_layer(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir, dtype="bfloat16", max_model_len=512, kv_cache_memory_gib=0.01)
    assert llm.llm_engine.model.model.fused_decode is None  # head_dim 16
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3


def test_float32_decodes_layer_by_layer(checkpoint: Path) -> None:
    llm = LLM(checkpoint, dtype="float32", max_model_len=512, kv_cache_memory_gib=0.01)
    assert llm.llm_engine.model.model.fused_decode is None
    with torch.inference_mode():
        out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3


def test_more_sequences_than_the_kernel_takes_decode_layer_by_layer(
    checkpoint: Path, calls: list[tuple[int, bool]]
) -> None:
    llm = LLM(checkpoint, dtype="bfloat16", max_model_len=256, max_num_seqs=80, kv_cache_memory_gib=0.04)
    prompts = [f"Number {i}" for i in range(FUSED_ROWS + 1)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert (FUSED_ROWS + 1, False) in calls  # the decode steps of all 73: layer by layer
    assert not any(fused for rows, fused in calls if rows > FUSED_ROWS)


@pytest.mark.slow
def test_qwen3_vl_moe_decodes_layer_by_layer(tmp_path: Path) -> None:
    spec = replace(qwen3_tiny.MOE_SPEC, **WIDE3)
    llm = LLM(qwen3_tiny.write_tiny_qwen3_vl(tmp_path / "moe", spec), dtype="bfloat16", max_model_len=256,
              kv_cache_memory_gib=0.01)  # fmt: skip
    assert llm.llm_engine.model.model.fused_decode is None  # its expert layers are not the kernel's
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3
