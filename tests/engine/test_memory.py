"""Memory planning: the arithmetic, the profile run, and refusals with numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import random_image
from vlmserve import LLM, SamplingParams
from vlmserve.engine.memory import GiB, PeakMeter, one_block_per_stack, plan_kv_cache
from vlmserve.multimodal.media import MediaError

PAD = "<|vision_start|><|image_pad|><|vision_end|>"


def test_plan_arithmetic() -> None:
    common = dict(
        weights_bytes=3 * GiB,
        activation_bytes=GiB,
        encoder_cache_bytes=GiB // 2,
        block_bytes=GiB // 64,
        block_size=16,
        min_blocks=8,
    )
    plan = plan_kv_cache(budget_bytes=8 * GiB, max_useful_blocks=10_000, **common)
    assert plan.num_blocks == 3.5 * 64 and not plan.capped  # 8 - 3 - 1 - 0.5 = 3.5 GiB
    capped = plan_kv_cache(budget_bytes=8 * GiB, max_useful_blocks=100, **common)
    assert capped.num_blocks == 100 and capped.capped
    with pytest.raises(
        ValueError,
        match=r"budget of 4.60 GiB is too small: weights 3.00 GiB \+ peak activations 1.00"
        r" GiB \+ encoder cache 0.50 GiB leave 0.10 GiB .* at least 8 blocks",
    ):
        plan_kv_cache(budget_bytes=int(4.6 * GiB), max_useful_blocks=100, **common)


def test_one_block_per_stack_restores_the_model() -> None:
    model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2) for _ in range(3)]))
    stack = model[0]
    with one_block_per_stack(model):
        assert len(model[0]) == 1 and model[0][0] is stack[0]
    assert model[0] is stack and len(stack) == 3


def test_meter_sees_a_large_temporary() -> None:
    meter = PeakMeter(torch.device("cpu"))
    before = meter.current()
    meter.reset()
    x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    del x
    assert meter.peak() - before >= 60 << 20


@pytest.fixture(scope="module")
def planned(tiny_dir: Path) -> LLM:
    return LLM(
        tiny_dir,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        memory_budget_gib=2.0,
        mm_processor_kwargs={"max_pixels": 512 * 28 * 28},
    )


def test_kv_cache_is_sized_from_what_the_budget_leaves(planned: LLM) -> None:
    plan = planned.llm_engine.memory_plan
    assert plan.profiled and plan.activation_bytes > 0
    assert plan.budget_bytes == 2 * GiB
    # 2 GiB is far more than 4 sequences of 2048 tokens need: capped at that.
    assert plan.capped and plan.num_blocks == 4 * 2048 // 16
    assert planned.llm_engine.kv.pool.num_blocks == plan.num_blocks
    # The worst case the plan measured includes the largest admitted image (512 tokens). A video
    # may fill a prompt (2047 tokens): engine/core.py plans with the image entry alone so far.
    assert planned.llm_engine.processor.max_tokens_per_item() == {"image": 512, "video": 2047}


def test_activation_peak_grows_with_the_token_budget(tiny_dir: Path) -> None:
    small = LLM(
        tiny_dir,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=2,
        max_num_batched_tokens=256,
        mm_processor_kwargs={"max_pixels": 64 * 28 * 28},
        # No video: a prompt-long video's encoding would be the peak of both, whatever the budget.
        limit_mm_per_prompt={"image": 8, "video": 0},
    ).llm_engine.memory_plan
    large = LLM(
        tiny_dir,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=2,
        max_num_batched_tokens=2048,
        mm_processor_kwargs={"max_pixels": 64 * 28 * 28},
        limit_mm_per_prompt={"image": 8, "video": 0},
    ).llm_engine.memory_plan
    # 8x the tokens: the 151936-wide logits of the sampled rows dominate neither; the MLP does.
    assert large.activation_bytes > small.activation_bytes


def test_too_small_a_budget_is_refused_with_numbers(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"memory budget of 0.05 GiB is too small: weights 0.0\d GiB"):
        LLM(tiny_dir, dtype="float32", max_model_len=2048, memory_budget_gib=0.05)


def test_requests_that_can_never_fit_are_refused_on_submit(planned: LLM) -> None:
    too_many_pixels = {
        "prompt": PAD,
        "multi_modal_data": {"image": random_image(1000, 800)},
        "mm_processor_kwargs": {"max_pixels": 2000 * 28 * 28},
    }
    with pytest.raises(MediaError, match=r"needs 1044 tokens, at most 512 per image are admitted \(max_pixels=401408"):
        planned.generate(too_many_pixels)
    with pytest.raises(ValueError, match=r"prompt needs 2048 tokens .* max_model_len=2048"):
        planned.generate({"prompt_token_ids": [1] * 2048})
    # Within the plan: served.
    ok = planned.generate(
        {"prompt": PAD + "hi", "multi_modal_data": {"image": random_image(1000, 800)}}, SamplingParams(max_tokens=3)
    )
    assert ok[0].num_image_tokens == [500]  # 700 x 560 under max_pixels


def test_fixed_kv_size_skips_profiling_and_refuses_what_it_cannot_hold(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir, dtype="float32", max_model_len=2048, kv_cache_memory_gib=8 * 16 * 512 / GiB)  # 8 blocks
    assert not llm.llm_engine.memory_plan.profiled and llm.llm_engine.kv.pool.num_blocks == 8
    with pytest.raises(ValueError, match=r"needs 10 KV blocks \(150 prompt tokens \+ 1, 16 per block\).*8 in all"):
        llm.generate({"prompt_token_ids": [1] * 150})
