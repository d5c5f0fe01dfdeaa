"""Speculative decoding (engine/speculative.py): the config as vLLM reads it, the n-gram proposer,
the backoff, the distribution a verified step samples from, and the engine's exactness where it is
hard: sampled and seeded requests, stop strings inside accepted drafts, grammars, preemption in
the middle of a verification."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.speculation import oracle_drafts
from vlmserve.engine.sampler import Sampler, TokenHistory
from vlmserve.engine.speculative import DraftBackoff, NgramIndex, SpeculativeConfig, verify_drafts
from vlmserve.sampling_params import SamplingParams, StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

# -- the config ----------------------------------------------------------------------------------


def test_the_config_reads_as_vllm_reads_it() -> None:
    parse = SpeculativeConfig.parse
    assert parse(None) is None
    assert parse({"method": "ngram", "num_speculative_tokens": 3}) == SpeculativeConfig("ngram", 3, 5, 5)
    assert parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}).prompt_lookup_max == 2
    assert parse({"method": "mtp"}) == SpeculativeConfig("mtp", 1)


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "above"),
        ({"method": "mtp", "prompt_lookup_max": 2}, "prompt_lookup_max is for method 'ngram'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown key"),
        ({"model": "some/draft", "num_speculative_tokens": 2}, "draft model is not supported"),
    ],
)
def test_a_wrong_config_is_refused_naming_what_is_wrong(raw: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig.parse(raw)


def test_the_server_flag_refuses_a_wrong_config_before_loading_anything() -> None:
    import argparse

    from vlmserve.arg_types import speculative_config

    assert speculative_config('{"method": "ngram", "num_speculative_tokens": 2}')["method"] == "ngram"
    for text, named in [("ngram", "expected a JSON object"), ('{"method": "x"}', "method must be one of")]:
        with pytest.raises(argparse.ArgumentTypeError, match=named):
            speculative_config(text)


# -- n-gram drafts and the backoff ---------------------------------------------------------------


def test_ngram_drafts_follow_the_longest_repeated_suffix() -> None:
    # ... 7 8 9 | 1 2 3 4 5 | 7 8 9 | 6 6 | 7 8 9: the suffix "7 8 9" occurred twice before; the
    # latest occurrence followed by 4 tokens is the second (6 6 7 8), the first one gives 1 2 3 4.
    index = NgramIndex([7, 8, 9, 1, 2, 3, 4, 5, 7, 8, 9, 6, 6, 7, 8, 9], [])
    assert index.propose(1, 3, 4) == [6, 6, 7, 8]
    assert index.propose(1, 3, 2) == [6, 6]
    index.extend([1])  # suffix "9 1": only after the first "7 8 9"
    assert index.propose(1, 3, 4) == [2, 3, 4, 5]
    assert index.propose(3, 3, 4) == [2, 3, 4, 5]  # "8 9 1" too
    assert index.propose(4, 4, 4) == [2, 3, 4, 5]  # "7 8 9 1": the sequence's start
    assert index.propose(5, 5, 4) == []  # "6 7 8 9 1" never came before
    index.extend([42])
    assert index.propose(1, 3, 4) == []  # 42 is new


def test_ngram_drafts_never_match_or_propose_image_placeholders() -> None:
    pad = 151655
    prompt = [5, 6, pad, pad, pad, 5, 6, 9, 9]
    index = NgramIndex(prompt, [(2, 5)])  # the image's placeholders
    index.extend([5])
    assert index.propose(1, 2, 3) == [6, 9, 9]  # after the second "5" (the first is followed by the image)
    index = NgramIndex([1, 2, pad, pad, 3], [(2, 4)])
    index.extend([1, 2])
    assert index.propose(1, 2, 3) == []  # "1 2" is followed by the image: nothing to draft
    index = NgramIndex([pad, pad, 1], [(0, 2)])
    index.extend([pad])  # a placeholder id the model wrote itself matches no placeholder position
    assert index.propose(1, 2, 3) == []


def test_the_backoff_drafts_less_then_pauses_longer_while_drafts_fail() -> None:
    backoff = DraftBackoff(4)
    counts = []
    for _ in range(95):
        n = backoff.next_count()
        counts.append(n)
        backoff.verified(n, 0)
    # 4, 2, 1, then pauses of 4, 16 and 64 steps (at most) between single drafts.
    assert counts[:3] == [4, 2, 1]
    assert counts[3:] == [0] * 4 + [1] + [0] * 16 + [1] + [0] * 64 + [1] + [0] * 5
    backoff.waiting = 0
    assert backoff.next_count() == 1
    backoff.verified(1, 1)  # accepted: the pauses end, and the count grows back
    assert backoff.next_count() == 2 and backoff.pause == 0
    backoff.verified(2, 2)
    assert backoff.next_count() == 4


# -- the distribution a verification samples from ------------------------------------------------

LOGITS = [[2.0, 1.5, 1.0, 0.2, -1.0, -3.0], [0.5, 1.8, -0.2, 1.1, 0.9, -2.0]]


def filtered_softmax(logits: list[float], temperature: float, top_k: int) -> np.ndarray:
    z = np.array(logits) / temperature
    keep = z >= np.sort(z)[::-1][top_k - 1]
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    return p / p.sum()


def test_verified_tokens_follow_the_target_distribution() -> None:
    """One draft per request: its first row's sample (the draft kept, or the token replacing it)
    follows the first row's distribution, and where the draft was kept the second row's sample
    follows the second's. Rows drawn with one shared random number (a wrong implementation)
    would keep the second row's draft... far too often; one that resampled a rejected draft from
    the whole distribution would give the draft too often."""
    temperature, top_k, draft, second_draft = 0.9, 4, 1, 3
    params = SamplingParams(temperature=temperature, top_k=top_k)
    requests = 8_000
    drafts = [[draft, second_draft]] * requests
    # each request's rows: its first row, the second (as if the draft were taken), then a third
    # row that follows a kept second draft (its logits: the first row's again)
    logits = torch.tensor([LOGITS[0], LOGITS[1], LOGITS[0]], dtype=torch.float32).repeat(requests, 1)
    generator = torch.Generator().manual_seed(20261129)
    rows = 3 * requests
    histories = [TokenHistory([0], 1)] * rows
    samples = Sampler()(logits, [params] * rows, [generator] * rows, histories)
    tokens = verify_drafts(samples, drafts)
    first = np.array([t[0] for t in tokens])
    kept = [t for t in tokens if t[0] == draft]
    second = np.array([t[1] for t in kept])
    vocab = len(LOGITS[0])
    log_term = math.log(2 * vocab * 2 / 1e-9)  # Bernstein's bound, union over tokens and rows (as the sampler's test)
    for counts_of, expected in (
        (first, filtered_softmax(LOGITS[0], temperature, top_k)),
        (second, filtered_softmax(LOGITS[1], temperature, top_k)),
    ):
        n = len(counts_of)
        counts = np.bincount(counts_of, minlength=vocab)
        variance = n * expected * (1 - expected)
        bound = log_term / 3 + np.sqrt(log_term**2 / 9 + 2 * log_term * variance)
        assert (np.abs(counts - n * expected) <= bound).all(), (counts, n * expected, bound)
    # A kept second draft is followed by a third sample; a replaced one ends the request's step.
    assert all(len(t) == (3 if t[1] == second_draft else 2) for t in kept)
    assert all(len(t) == 1 for t in tokens if t[0] != draft)


# -- through the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_dir: Path) -> Any:
    """The tiny Qwen2-VL without and with n-gram speculation, a small KV cache each."""
    from vlmserve import LLM

    plain = LLM(tiny_dir, dtype="float32", max_model_len=512, kv_cache_memory_gib=0.01)
    speculative = LLM(tiny_dir, dtype="float32", max_model_len=512, kv_cache_memory_gib=0.01, speculative_config=NGRAM)
    yield plain, speculative
    plain.shutdown()
    speculative.shutdown()


PROMPTS = ["Count: one two three one two three one two", "The sea, the sea, the grey sea", "Hello"]


def test_seeded_sampled_requests_are_reproducible_and_sampled_ones_run(engines: Any) -> None:
    _, speculative = engines
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=40, repetition_penalty=1.05)
    first = [o.outputs[0].token_ids for o in speculative.generate(PROMPTS, seeded)]
    answers = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in speculative.generate(PROMPTS, seeded)}
    assert [answers[tuple(o.prompt_token_ids)] for o in speculative.generate(PROMPTS, seeded)] == first
    core = speculative.llm_engine.core
    before = core.spec_stats.num_accepted_tokens
    with oracle_drafts(core, answers):  # drafts that are mostly right: many kept in one step
        again = [o.outputs[0].token_ids for o in speculative.generate(PROMPTS, seeded)]
    assert core.spec_stats.num_accepted_tokens > before
    assert all(len(a) == 40 for a in again)  # seeded, with other drafts: its own reproducible tokens


def test_a_stop_string_inside_accepted_drafts_ends_the_output_where_it_would_without(engines: Any) -> None:
    plain, speculative = engines
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompt = [PROMPTS[2]]
    (whole,) = plain.generate(prompt, greedy)
    ids = whole.outputs[0].token_ids
    # The two tokens where the output first changes after its tenth: text that ends inside it.
    at = next(k for k in range(10, len(ids)) if ids[k] != ids[k - 1])
    stop = plain.get_tokenizer().decode(ids[at - 1 : at + 1])
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop], logprobs=1)
    (expected,) = plain.generate(prompt, params)
    assert len(expected.outputs[0].token_ids) <= at + 1 < len(ids)
    core = speculative.llm_engine.core
    with oracle_drafts(core, {tuple(whole.prompt_token_ids): ids}, lambda answer, done: answer[done : done + 6]):
        (got,) = speculative.generate(prompt, params)
    assert got.outputs[0].text == expected.outputs[0].text
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.outputs[0].logprobs is not None and len(got.outputs[0].logprobs) == len(got.outputs[0].token_ids)
    assert got.outputs[0].finish_reason == "stop" and got.outputs[0].num_accepted_tokens >= 6


def test_drafts_a_grammar_forbids_are_cut_and_the_output_is_the_grammars(engines: Any) -> None:
    plain, speculative = engines
    choice = StructuredOutputsParams(choice=["red apple pie", "green tea", "blue whale song"])
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=choice)
    expected = [o.outputs[0].text for o in plain.generate(PROMPTS, params)]
    tokenizer = plain.get_tokenizer()
    # Drafts that spell another choice: the grammar allows their first tokens at most.
    wrong = tokenizer.encode("blue whale song green tea")
    answers = {tuple(o.prompt_token_ids): wrong for o in plain.generate(PROMPTS, params)}
    core = speculative.llm_engine.core
    with oracle_drafts(core, answers, lambda answer, done: answer[:4]):
        got = [o.outputs[0].text for o in speculative.generate(PROMPTS, params)]
    assert got == expected and set(got) <= {"red apple pie", "green tea", "blue whale song"}


def test_preempted_in_the_middle_of_verifications_the_tokens_are_greedys(tiny_dir: Path) -> None:
    """A KV cache too small for every request at once: requests verifying drafts are preempted and
    recomputed; the greedy tokens stay those of the engine without speculation."""
    from vlmserve import LLM

    prompts = [f"Item {i}: red blue red blue red blue red" for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain = LLM(tiny_dir, dtype="float32", max_model_len=256, kv_cache_memory_gib=0.01)
    # 14 blocks of 16 tokens: room for three of the six requests' ~75 tokens at a time
    small = {"dtype": "float32", "max_model_len": 256}
    small["kv_cache_memory_gib"] = 14 * 16 * plain.llm_engine.core.runner.kv_bytes_per_token / (1 << 30)
    outputs = plain.generate(prompts, greedy)
    plain.shutdown()
    expected = [o.outputs[0].token_ids for o in outputs]
    speculative = LLM(tiny_dir, **small, speculative_config=NGRAM)
    core = speculative.llm_engine.core
    assert core.kv.pool.num_blocks == 14
    answers = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outputs}
    with oracle_drafts(core, answers):
        got = [o.outputs[0].token_ids for o in speculative.generate(prompts, greedy)]
    assert got == expected
    assert core.scheduler.num_preemptions > 0 and core.spec_stats.num_accepted_tokens > 0
    assert core.kv.pool.num_free == core.kv.pool.num_blocks
    speculative.shutdown()


# -- Qwen3.5's MTP head --------------------------------------------------------------------------


def test_mtp_drafts_are_the_published_heads_over_the_models_hidden_states(tiny35_dir: Path, hf35_model: Any) -> None:
    """The head's drafts as the engine makes them step by step (its KV filled by prefill chunks,
    decode steps and verifications, draft steps one position on, a rejected draft's state put
    back) are a plain-torch transcription of the published head run over transformers' hidden
    states of the same tokens, whole: the hidden state of each position beside the token after
    it, then each draft beside the head's own output. The greedy tokens are those without
    speculation, the drafts verified and counted."""
    from tests.models.test_qwen3_5_mtp import checkpoint, reference_head
    from vlmserve import LLM
    from vlmserve.engine import model_runner

    recorded: list[tuple[list[int], list[int]]] = []
    real = model_runner.draft_head_propose

    def record(model: Any, batch: Any, hidden: Any, step: Any, out: Any, *rest: Any) -> None:
        real(model, batch, hidden, step, out, *rest)
        for state in batch.sampled:
            if state.request_id in out.draft_token_ids:
                recorded.append((list(state.token_ids), out.draft_token_ids[state.request_id]))

    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompt = "Describe the sea in twenty words or so, please, one word at a time."
    small = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_gib": 0.01, "max_num_batched_tokens": 8}
    plain = LLM(tiny35_dir, **small)
    (expected,) = plain.generate([prompt], greedy)
    plain.shutdown()
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    mtp = LLM(tiny35_dir, **small, speculative_config=spec)
    model_runner.draft_head_propose = record
    try:
        (got,) = mtp.generate([prompt], greedy)
    finally:
        model_runner.draft_head_propose = real
        mtp.shutdown()
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.outputs[0].num_draft_tokens > 0
    assert len(recorded) >= 4 and len(recorded[0][1]) == 3  # (fewer later: the backoff, as they fail)
    weights, text = checkpoint(tiny35_dir)
    lm_head = weights.get("lm_head.weight", weights["model.language_model.embed_tokens.weight"])  # tied
    for tokens, drafts in recorded:
        ids = torch.tensor(tokens)
        n = len(tokens) - 1  # the hidden states of every token but the newest
        with torch.no_grad():
            hidden = hf35_model.model(input_ids=ids[None, :n]).last_hidden_state[0]
        rows_ids, rows_hidden = ids[1:], hidden  # position i: hidden i beside token i + 1
        want: list[int] = []
        while len(want) < len(drafts):
            positions = torch.arange(len(rows_ids)).expand(3, -1)
            out = reference_head(weights, text, rows_ids, rows_hidden, positions)
            want.append(int((out[-1] @ lm_head.T).argmax()))
            rows_ids = torch.cat([rows_ids, torch.tensor(want[-1:])])  # the draft, beside the head's output
            rows_hidden = torch.cat([rows_hidden, out[-1:]])
        assert drafts == want, (len(tokens), drafts, want)
