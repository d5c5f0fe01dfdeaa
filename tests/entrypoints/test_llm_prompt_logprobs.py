"""prompt_logprobs and allowed_token_ids in the offline API, against transformers' log-softmax of
the same prompt on the same checkpoint (float32). The engine's step budget is 8 tokens, so every
prompt here is computed in several chunks, batched with the others (one holds two images)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.reference import hf_logits, hf_prompt_ids
from vlmserve import LLM, SamplingParams
from vlmserve.outputs import Logprob

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
TEXT = "<|im_start|>user\nTell me a story about a lighthouse and its keeper.<|im_end|>\n<|im_start|>assistant\n"
IMAGE = f"<|im_start|>user\n{PAD}{PAD}Which of the two is darker?<|im_end|>\n<|im_start|>assistant\n"
BUDGET = 8


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    return LLM(
        tiny_dir,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=8,
        max_num_batched_tokens=BUDGET,
        kv_cache_memory_gib=0.02,
        max_logprobs=-1,
    )


def reference(hf_model, hf_tokenizer, hf_image_processor, text: str, pictures: list[Image.Image]):  # type: ignore[no-untyped-def]
    """(prompt ids, [len - 1, vocab] log-softmax: row i scores prompt token i + 1)."""
    ids, vision = hf_prompt_ids(hf_tokenizer, hf_image_processor, text, pictures)
    return ids, torch.log_softmax(hf_logits(hf_model, ids, vision).double(), dim=-1)[:-1]


def check(prompt_logprobs: list[dict[int, Logprob] | None] | None, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    for i, entry in enumerate(prompt_logprobs[1:]):
        assert entry is not None
        row, token = ref[i], ids[i + 1]
        # The prompt's own token, and the k most likely ones (by value: ties may swap ids).
        assert token in entry and len(entry) in (k, k + 1)
        top = sorted((lp.logprob for t, lp in entry.items() if t != token or lp.rank <= k), reverse=True)
        assert top[:k] == pytest.approx(row.topk(k).values.tolist(), abs=1e-4)
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[tid]), abs=1e-4)
            # 1 + the tokens more likely; ties closer than 1e-5 may go either way.
            assert 1 + int((row > row[tid] + 1e-5).sum()) <= lp.rank <= int((row >= row[tid] - 1e-5).sum())


def test_prompt_logprobs_of_chunked_batched_prompts_equal_transformers(  # type: ignore[no-untyped-def]
    llm: LLM, images, hf_model, hf_tokenizer, hf_image_processor
) -> None:
    pictures = [images["tall"], images["odd"]]
    text_ids, text_ref = reference(hf_model, hf_tokenizer, hf_image_processor, TEXT, [])
    image_ids, image_ref = reference(hf_model, hf_tokenizer, hf_image_processor, IMAGE, pictures)
    assert len(text_ids) > BUDGET and len(image_ids) > 3 * BUDGET
    # The text prompt first alone, without prompt logprobs: its blocks are now in the prefix cache.
    plain = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None
    outs = llm.generate(
        [TEXT, {"prompt": IMAGE, "multi_modal_data": {"image": pictures}}, TEXT],
        [
            SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
            SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, logprobs=1),
            SamplingParams(temperature=0, max_tokens=2),  # batched beside them, asks for none
        ],
    )
    check(outs[0].prompt_logprobs, text_ids, text_ref, 2)
    check(outs[1].prompt_logprobs, image_ids, image_ref, 3)
    assert outs[2].prompt_logprobs is None and outs[2].num_cached_tokens > 0
    # The prefix cache held the text prompt; prompt logprobs computed every row all the same.
    assert outs[0].num_cached_tokens == 0
    # Asking for them changes nothing generated.
    assert outs[0].outputs[0].token_ids == plain.outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_minus_one_is_the_whole_vocabulary_where_max_logprobs_allows(  # type: ignore[no-untyped-def]
    llm: LLM, hf_model, hf_tokenizer, hf_image_processor
) -> None:
    text = "Hello there"
    ids, ref = reference(hf_model, hf_tokenizer, hf_image_processor, text, [])
    out = llm.generate(text, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=-1))[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids) == 2
    entry = out.prompt_logprobs[1]
    assert entry is not None and len(entry) == ref.shape[-1]
    values = torch.tensor([entry[t].logprob for t in range(ref.shape[-1])], dtype=torch.float64)
    assert torch.allclose(values, ref[0], atol=1e-4)
    # With vLLM's default --max-logprobs (20), -1 and 21 are refused by name.
    frontend = dataclasses.replace(llm.llm_engine.frontend, max_logprobs=20)
    for params, name in (
        (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
        (SamplingParams(logprobs=21), "logprobs"),
    ):
        with pytest.raises(ValueError, match=f"^{name} requests"):
            frontend.resolve_params(params)
    assert frontend.resolve_params(SamplingParams(prompt_logprobs=20)).prompt_logprobs == 20


def test_allowed_token_ids_mask_every_other_token(  # type: ignore[no-untyped-def]
    llm: LLM, hf_model, hf_tokenizer, hf_image_processor
) -> None:
    ids, _ = reference(hf_model, hf_tokenizer, hf_image_processor, TEXT, [])
    last = hf_logits(hf_model, ids, {})[-1]
    # Two unlikely tokens: greedy picks the likelier of the two, never the model's first choice.
    order = last.argsort(descending=True).tolist()
    allowed = [order[5000], order[100]]
    out = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=allowed, logprobs=0))[0]
    tokens = out.outputs[0].token_ids
    assert tokens[0] == order[100] and set(tokens) <= set(allowed)
    # Sampled too, with a batch neighbour that is not masked.
    outs = llm.generate(
        [TEXT, TEXT],
        [
            SamplingParams(temperature=1.0, seed=1, max_tokens=6, allowed_token_ids=allowed),
            SamplingParams(temperature=0, max_tokens=1),
        ],
    )
    assert set(outs[0].outputs[0].token_ids) <= set(allowed)
    assert outs[1].outputs[0].token_ids == [order[0]]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(TEXT, SamplingParams(allowed_token_ids=[10**7]))


@pytest.mark.slow
def test_preempted_requests_keep_their_prompt_logprobs(
    tiny_dir: Path, hf_model, hf_tokenizer, hf_image_processor
) -> None:  # type: ignore[no-untyped-def]
    """A KV pool of 6 blocks of 16 tokens for four requests of 41 + 16 tokens: requests are
    preempted (some before their prompt is done, some after their first token) and recomputed;
    their prompt logprobs are transformers' all the same."""
    small = LLM(
        tiny_dir,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=20,
        kv_cache_memory_gib=6 * 16 * 512 / (1 << 30),
    )  # 512 B/token
    engine = small.llm_engine
    assert engine.kv.pool.num_blocks == 6
    preempted_at: list[int] = []  # output tokens each preempted request had
    original = engine.scheduler._preempt

    def counting(request):  # type: ignore[no-untyped-def]
        preempted_at.append(len(request.output_token_ids))
        original(request)

    engine.scheduler._preempt = counting  # type: ignore[method-assign]
    texts = [
        f"Story {i}: the keeper of the lighthouse counted {i} ships passing by the rocks at night, "
        "wrote each name in his book, and lit the lamp again before the storm came over the bay."
        for i in range(4)
    ]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    outs = small.generate(texts, params)
    # Both kinds: before the prompt was done (its rows computed again) and after a first token.
    assert 0 in preempted_at and max(preempted_at) > 0
    for text, out in zip(texts, outs, strict=True):
        ids, ref = reference(hf_model, hf_tokenizer, hf_image_processor, text, [])
        check(out.prompt_logprobs, ids, ref, 2)
