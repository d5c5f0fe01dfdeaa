"""A pooling model's engine sizes its KV cache from the measured worst-case step, as a generating
one does: the step's rows go to the pooler, not through logits and the sampler (an embedding
checkpoint has no lm_head; a reranker's is dropped once its two rows are taken)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmserve import LLM

# vLLM's way to serve Qwen3-VL-Reranker: a sequence classifier scoring "yes" against "no".
RERANKER = {"architectures": ["Qwen3VLForSequenceClassification"], "classifier_from_token": ["no", "yes"]}


@pytest.mark.parametrize("checkpoint", ["embedding_dir", "reranker_dir"])
def test_the_memory_plan_profiles_a_pooling_model(checkpoint: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(checkpoint)
    overrides = RERANKER if checkpoint == "reranker_dir" else None
    # No KV cache size given: the plan runs the worst-case step.
    llm = LLM(model_dir, dtype="float32", max_model_len=256, max_num_seqs=4, hf_overrides=overrides)
    plan = llm.llm_engine.core.memory_plan
    assert plan.profiled and plan.activation_bytes > 0 and plan.num_blocks > 0
    if checkpoint == "embedding_dir":
        (out,) = llm.embed("a picture of a cat")
        assert sum(v * v for v in out.outputs.embedding) == pytest.approx(1.0, abs=1e-5)
    else:
        (out,) = llm.score("a cat", "a picture of a cat")
        assert 0.0 < out.outputs.score < 1.0
