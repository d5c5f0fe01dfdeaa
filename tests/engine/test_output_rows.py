"""The last decoder layer computes only the rows a step uses (AttentionMetadata.output_rows): past
attention, a prompt's other rows need no output projection and no MLP. What is sampled and every
logprob stay those of the whole computation; prompt logprobs keep every row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from vlmserve import LLM, SamplingParams


def _rows_seen(llm: LLM) -> tuple[list[int], list[int]]:
    """Rows entering the first and the last decoder layer's MLP, step by step."""
    layers = llm.llm_engine.model.model.layers
    first: list[int] = []
    last: list[int] = []
    layers[0].mlp.register_forward_pre_hook(lambda _, args: first.append(args[0].shape[0]))
    layers[-1].mlp.register_forward_pre_hook(lambda _, args: last.append(args[0].shape[0]))
    return first, last


def _run(llm: LLM, messages: list[dict], params: SamplingParams):  # type: ignore[no-untyped-def]
    llm.llm_engine.reset_prefix_cache()  # every run computes the whole prompt
    (out,) = llm.chat(messages, params)
    return out


@pytest.mark.parametrize("checkpoint", ["tiny_dir", "tiny3_dir"])  # Qwen2-VL; Qwen3-VL with DeepStack
def test_last_layer_runs_only_the_sampled_rows_with_the_same_results(
    checkpoint: str, request: pytest.FixtureRequest, images: dict[str, Image.Image]
) -> None:
    path: Path = request.getfixturevalue(checkpoint)
    # A budget of 16 tokens: the prompt (an image and text) is prefilled in several chunks.
    llm = LLM(path, dtype="float32", max_model_len=1024, max_num_seqs=2, max_num_batched_tokens=16, max_logprobs=-1)
    first, last = _rows_seen(llm)
    messages = [
        {"role": "user", "content": [{"type": "image", "image": images["wide"]}, {"type": "text", "text": "Describe."}]}
    ]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5)

    pruned = _run(llm, messages, params)
    prompt_len = len(pruned.prompt_token_ids)
    chunks = -(-prompt_len // 16)
    assert chunks >= 3 and sum(first[:chunks]) == prompt_len
    # every chunk's last layer: one row (the last chunk's sampled row; the others, their last row)
    assert last == [1] * (chunks + 3)

    llm.llm_engine.model.prunes_output_rows = False  # the whole computation, for comparison
    first.clear(), last.clear()
    whole = _run(llm, messages, params)
    assert last[:chunks] == first[:chunks] and sum(last[:chunks]) == prompt_len
    assert pruned.outputs[0].token_ids == whole.outputs[0].token_ids
    for ours, theirs in zip(pruned.outputs[0].logprobs, whole.outputs[0].logprobs, strict=True):
        assert ours.keys() == theirs.keys()
        for token, lp in ours.items():
            assert lp.logprob == pytest.approx(theirs[token].logprob, abs=1e-5)

    # Prompt logprobs score every prompt row: nothing is pruned, and they match the whole run's.
    llm.llm_engine.model.prunes_output_rows = True
    first.clear(), last.clear()
    scored = _run(llm, messages, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    assert last[:chunks] == first[:chunks]
    llm.llm_engine.model.prunes_output_rows = False
    reference = _run(llm, messages, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    assert scored.prompt_logprobs is not None and reference.prompt_logprobs is not None
    for ours, theirs in zip(scored.prompt_logprobs[1:], reference.prompt_logprobs[1:], strict=True):
        assert ours is not None and theirs is not None and ours.keys() == theirs.keys()
        assert [lp.logprob for lp in ours.values()] == pytest.approx([lp.logprob for lp in theirs.values()], abs=1e-5)


def test_a_batch_keeps_each_requests_sampled_row(tiny_dir: Path) -> None:
    """Two prompts in one step: the last layer sees their two last rows, and each request gets its
    own continuation (greedy, as each one alone)."""
    llm = LLM(tiny_dir, dtype="float32", max_model_len=512, max_num_seqs=2)
    first, last = _rows_seen(llm)
    prompts = [{"prompt_token_ids": list(range(100, 130))}, {"prompt_token_ids": list(range(300, 311))}]
    params = SamplingParams(temperature=0, max_tokens=3)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert first[0] == 41 and last[0] == 2
    llm.llm_engine.reset_prefix_cache()
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    assert torch.tensor(last).max().item() <= 2
