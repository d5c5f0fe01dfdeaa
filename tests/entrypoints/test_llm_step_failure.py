"""Offline: a request whose step fails ends as aborted (the engine goes on without it) and the
other requests of the same generate() call get the tokens they get alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlmserve import LLM, SamplingParams

POISON_SEED = 666


def test_a_failing_request_is_aborted_and_the_rest_of_the_batch_is_unchanged(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(tiny_dir, dtype="float32", max_model_len=512, kv_cache_memory_gib=0.01)
    prompts = ["The capital of France", "One two three", "A poisoned request"]
    good = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    alone = [llm.generate(p, good)[0].outputs[0].token_ids for p in prompts[:2]]

    sampler = llm.llm_engine.runner.sampler
    original = type(sampler).__call__

    def failing(self, logits: torch.Tensor, params: list[SamplingParams], *rest):  # type: ignore[no-untyped-def]
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("injected sampler failure")
        return original(self, logits, params, *rest)

    monkeypatch.setattr(type(sampler), "__call__", failing)
    poisoned = SamplingParams(temperature=0.8, seed=POISON_SEED, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(prompts, [good, good, poisoned])
    assert [o.outputs[0].token_ids for o in outputs[:2]] == alone
    assert outputs[2].finished and outputs[2].outputs[0].finish_reason == "abort"
    assert not llm.llm_engine.has_unfinished_requests() and llm.llm_engine.kv.usage == 0.0


def test_a_scheduler_error_aborts_the_requests_in_flight_and_the_engine_goes_on(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(tiny_dir, dtype="float32", max_model_len=512, kv_cache_memory_gib=0.01)
    prompts = ["The capital of France", "One two three"]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]

    engine = llm.llm_engine
    real = engine.scheduler.schedule
    calls = [0]

    def failing():  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 3:  # both requests are running by then, holding KV blocks
            raise RuntimeError("injected scheduler failure")
        return real()

    monkeypatch.setattr(engine.scheduler, "schedule", failing)
    outputs = llm.generate(prompts, params)
    assert [(o.finished, o.outputs[0].finish_reason) for o in outputs] == [(True, "abort")] * 2
    assert all(0 < len(o.outputs[0].token_ids) < 6 for o in outputs)
    # Nothing held: the caches the LLM's shortcuts point at are the ones the engine emptied.
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks and not engine.scheduler.requests
    assert not engine.has_unfinished_requests()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == alone
