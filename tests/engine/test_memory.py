"""Memory planning: the arithmetic, the profile run, and refusals with numbers."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

from tests.conftest import random_image
from vlmserve import LLM, SamplingParams
from vlmserve.engine.memory import GiB, PeakMeter, one_block_per_stack, plan_kv_cache
from vlmserve.engine.model_runner import ModelRunner
from vlmserve.families.qwen2_vl.model import Qwen2VLForConditionalGeneration
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


def test_the_grammar_cache_is_planned_where_it_shares_memory_with_the_kv_cache() -> None:
    """Compiled grammars live in host memory: on the CPU the KV cache is sized after their cache;
    on CUDA (in_budget False) the plan shows them outside the device's budget."""
    common: dict[str, Any] = dict(
        budget_bytes=8 * GiB,
        weights_bytes=3 * GiB,
        activation_bytes=GiB,
        encoder_cache_bytes=GiB // 2,
        block_bytes=GiB // 64,
        block_size=16,
        min_blocks=8,
        max_useful_blocks=10_000,
        grammar_cache_bytes=GiB // 2,
    )
    cpu = plan_kv_cache(**common)
    assert cpu.num_blocks == 3 * 64  # 8 - 3 - 1 - 0.5 - 0.5 (grammars) = 3 GiB
    assert "grammar cache 0.50 GiB, KV cache 3.00 GiB" in cpu.describe()
    cuda = plan_kv_cache(**common, grammar_cache_in_budget=False)
    assert cuda.num_blocks == 3.5 * 64
    assert cuda.describe().endswith("; grammar cache 0.50 GiB in host memory")
    with pytest.raises(ValueError, match=r"\+ grammar cache 4.00 GiB \(--grammar-cache-gib\) leave 0.00 GiB"):
        plan_kv_cache(**(common | {"grammar_cache_bytes": 4 * GiB}))


def test_one_block_per_stack_restores_the_model() -> None:
    model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2) for _ in range(3)]))
    stack = model[0]
    with one_block_per_stack(model):
        assert len(model[0]) == 1 and model[0][0] is stack[0]
    assert model[0] is stack and len(stack) == 3


def test_meter_reset_forgets_an_earlier_peak_and_sees_a_later_temporary() -> None:
    meter = PeakMeter(torch.device("cpu"))
    earlier = torch.ones(256 << 20, dtype=torch.uint8)  # 256 MiB, touched, then freed
    del earlier
    meter.reset()
    before = meter.current()
    # A reset that does nothing would report the 256 MiB (or any larger lifetime peak) here.
    assert meter.peak() - before < 128 << 20
    x = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    del x
    assert meter.peak() - before >= 60 << 20


def test_meter_sees_a_temporary_that_reuses_heap_memory_freed_earlier() -> None:
    # What a long process (many engines, many tests) leaves: freeing a 30 MiB mmap'ed chunk makes
    # glibc serve later large blocks from the heap, and eight freed 16 MiB blocks, each kept
    # apart by a live 200 KiB one, stay resident inside it. A peak read as RSS growth without
    # giving those pages back first saw 0 bytes of the 64 MiB below.
    meter = PeakMeter(torch.device("cpu"))
    mapped = torch.ones(30 << 20, dtype=torch.uint8)
    del mapped
    freed, pins = [], []
    for _ in range(8):
        freed.append(torch.ones(16 << 20, dtype=torch.uint8))
        pins.append(torch.ones(200 << 10, dtype=torch.uint8))
    del freed
    meter.reset()
    before = meter.current()
    temporaries = [torch.ones(8 << 20, dtype=torch.uint8) for _ in range(8)]  # 64 MiB, touched
    del temporaries
    assert meter.peak() - before >= 60 << 20
    assert len(pins) == 8


@dataclass
class ProfileRecord:
    """What building an engine measured: each value profile_run returned, and each vision
    encoder pass as (modality, length, grid_thw, rows of encoder output) per item."""

    activations: list[int] = field(default_factory=list)
    encoded: list[list[tuple[str, int, tuple[int, int, int], int]]] = field(default_factory=list)


@contextlib.contextmanager
def recording_profile() -> Iterator[ProfileRecord]:
    record = ProfileRecord()
    profile_run, embed_multimodal = ModelRunner.profile_run, Qwen2VLForConditionalGeneration.embed_multimodal

    def recorded_profile_run(self: ModelRunner, *args: Any, **kwargs: Any) -> int:
        record.activations.append(profile_run(self, *args, **kwargs))
        return record.activations[-1]

    def recorded_embed(self: Qwen2VLForConditionalGeneration, items: list[Any]) -> list[torch.Tensor]:
        out = embed_multimodal(self, items)
        record.encoded.append([(i.modality, i.length, i.grid_thw, o.shape[0]) for i, o in zip(items, out, strict=True)])
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ModelRunner, "profile_run", recorded_profile_run)
        mp.setattr(Qwen2VLForConditionalGeneration, "embed_multimodal", recorded_embed)
        yield record


def float32_weight_bytes(model_dir: Path) -> int:
    """Every tensor the checkpoint holds (tied lm_head: stored once), at 4 bytes a value."""
    total = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (safe_open is not iterable)
    return 4 * total


@pytest.fixture(scope="module")
def planned_profile(tiny_dir: Path) -> tuple[LLM, ProfileRecord]:
    with recording_profile() as record:
        llm = LLM(
            tiny_dir,
            dtype="float32",
            max_model_len=2048,
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            memory_budget_gib=2.0,
            mm_processor_kwargs={"max_pixels": 512 * 28 * 28},
        )
    return llm, record


@pytest.fixture(scope="module")
def planned(planned_profile: tuple[LLM, ProfileRecord]) -> LLM:
    return planned_profile[0]


@dataclass(frozen=True)
class Sizes:
    """The tiny checkpoint's sizes, from its files: float32 weights, bytes of one 16-token KV
    block (K and V, every layer), bytes of one encoder output token."""

    weights: int
    block: int
    encoder_token: int


@pytest.fixture(scope="module")
def sizes(tiny_dir: Path) -> Sizes:
    text = json.loads((tiny_dir / "config.json").read_text())
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    block = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim * 4 * 16
    return Sizes(float32_weight_bytes(tiny_dir), block, text["hidden_size"] * 4)


# The planned engine: a video may fill a prompt (max_model_len - 1 = 2047 tokens), more than the
# 512-token image max_pixels allows and than the 1024-token step budget; so a step may encode
# 2047 tokens, and the encoder cache holds 2047 tokens.
LARGEST_VIDEO = 2048 - 1


def test_kv_cache_is_sized_from_what_the_budget_leaves(
    planned_profile: tuple[LLM, ProfileRecord], sizes: Sizes
) -> None:
    llm, record = planned_profile
    plan = llm.llm_engine.memory_plan
    assert plan.profiled and record.activations == [plan.activation_bytes] and plan.activation_bytes > 0
    assert plan.budget_bytes == 2 * GiB
    assert plan.weights_bytes == sizes.weights
    assert plan.encoder_cache_bytes == LARGEST_VIDEO * sizes.encoder_token
    assert plan.block_bytes == sizes.block
    assert plan.grammar_cache_bytes == GiB // 2 and plan.grammar_cache_in_budget  # the default, on the CPU
    left = 2 * GiB - sizes.weights - plan.activation_bytes - LARGEST_VIDEO * sizes.encoder_token - GiB // 2
    fit = left // sizes.block
    # 2 GiB leaves far more than 4 sequences of 2048 tokens need: capped at that.
    cap = 4 * 2048 // 16
    assert fit > cap and plan.capped and plan.num_blocks == cap
    assert llm.llm_engine.kv.pool.num_blocks == plan.num_blocks


def test_kv_blocks_are_what_a_tight_budget_leaves_after_the_measured_step(
    planned_profile: tuple[LLM, ProfileRecord], sizes: Sizes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Re-plan the same engine with its measured step replayed and a budget that leaves room for
    # 300 blocks and a bit (< 512, the cap) after the grammar cache: what the KV cache gets is the
    # plan's arithmetic.
    llm, record = planned_profile
    core = llm.llm_engine.core
    measured = record.activations[0]
    monkeypatch.setattr(core.runner, "profile_run", lambda *args, **kwargs: measured)
    encoder_cache = LARGEST_VIDEO * sizes.encoder_token
    grammars = core.config.grammar_cache_bytes
    budget = sizes.weights + measured + encoder_cache + grammars + 300 * sizes.block + sizes.block - 1
    monkeypatch.setattr(core, "config", dataclasses.replace(core.config, memory_budget_bytes=budget))
    plan = core._plan_memory(core.scheduler.config, "video", LARGEST_VIDEO)
    assert (plan.num_blocks, plan.capped, plan.activation_bytes) == (300, False, measured)


def test_memory_plan_profiles_the_largest_admitted_video(planned_profile: tuple[LLM, ProfileRecord]) -> None:
    llm, record = planned_profile
    assert llm.llm_engine.processor.max_tokens_per_item() == {"image": 512, "video": LARGEST_VIDEO}
    assert len(record.encoded) == 1  # one vision pass: the profile's
    items = record.encoded[0]
    assert {modality for modality, *_ in items} == {"video"}
    # A step may encode a whole prompt-long video: the profile encodes that many video tokens,
    # in frames as large as a video frame may be (qwen-vl-utils' VIDEO_MAX_TOKEN_NUM, 768
    # merged tokens: the largest segment of the vision tower's attention).
    assert sum(length for _, length, _, _ in items) == LARGEST_VIDEO
    assert max(h * w // 4 for _, _, (_, h, w), _ in items) == 768
    assert all(length == t * h * w // 4 == rows for _, length, (t, h, w), rows in items)


def test_activation_peak_grows_with_the_token_budget(tiny_dir: Path) -> None:
    plans, records = [], []
    for step_tokens in (256, 2048):
        with recording_profile() as record:
            llm = LLM(
                tiny_dir,
                dtype="float32",
                max_model_len=2048,
                max_num_seqs=2,
                max_num_batched_tokens=step_tokens,
                mm_processor_kwargs={"max_pixels": 64 * 28 * 28},
                # No video: a prompt-long video's encoding would be the peak of both, whatever the budget.
                limit_mm_per_prompt={"image": 8, "video": 0},
            )
        plans.append(llm.llm_engine.memory_plan)
        records.append(record)
    small, large = plans
    # 8x the tokens: the 151936-wide logits of the sampled rows dominate neither; the MLP does.
    assert large.activation_bytes > small.activation_bytes
    # Images are the largest item now (64 tokens at max_pixels): the profile encodes a step's
    # worth of them, 256 and 2048 tokens (requests together may hold more than 8).
    for record, step_tokens in zip(records, (256, 2048), strict=True):
        (items,) = record.encoded
        assert [(modality, length) for modality, length, _, _ in items] == [("image", 64)] * (step_tokens // 64)


def test_too_small_a_budget_is_refused_with_numbers(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"memory budget of 0.05 GiB is too small: weights 0.0\d GiB"):
        LLM(tiny_dir, dtype="float32", max_model_len=2048, memory_budget_gib=0.05)


def test_requests_that_can_never_fit_are_refused_on_submit(planned: LLM) -> None:
    too_many_pixels = {
        "prompt": PAD,
        "multi_modal_data": {"image": random_image(1000, 800)},
        "mm_processor_kwargs": {"max_pixels": 2000 * 28 * 28},
    }
    # A per-image max_pixels above the engine's (whose image would need 1044 tokens of the 512 admitted) is
    # refused on submit, naming both numbers, before the image is decoded.
    with pytest.raises(MediaError, match=r"max_pixels=1568000 exceeds the server's max_pixels=401408"):
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


def test_gpu_memory_utilization_is_the_share_of_the_device_less_what_is_held_outside_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA (faked here: no GPU in CI) the budget is gpu_memory_utilization of the device less
    the memory in use there that this process's torch allocator does not hold."""
    from vlmserve.engine.config import EngineConfig
    from vlmserve.engine.memory import default_budget

    total, free, reserved = 80 * GiB, 70 * GiB, 2 * GiB  # 8 GiB held outside torch (context, others)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved)
    cuda = torch.device("cuda")
    assert default_budget(cuda) == int(0.9 * total) - 8 * GiB
    assert default_budget(cuda, 0.5) == 32 * GiB
    with pytest.raises(
        ValueError, match=r"gpu_memory_utilization 0.1 gives 8.00 GiB .* 8.00 GiB of it is already in use"
    ):
        default_budget(cuda, 0.1)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=rf"gpu_memory_utilization must be in \(0, 1\], got {bad}"):
            EngineConfig(model="m", gpu_memory_utilization=bad)
