from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vlmserve.engine.sampler import Sampler, apply_top_k_top_p
from vlmserve.sampling_params import SamplingParams


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 4.0]])
    assert Sampler()(logits, [SamplingParams(temperature=0)] * 2, [None, None]) == [1, 0]


def test_top_k_and_top_p_cut_the_tail() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]  # 0.5 < 0.7 <= 0.8
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.01]))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]  # the top token always stays


def test_seeded_sampling_is_reproducible_and_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None].repeat(3000, 1)
    params = [SamplingParams(temperature=1.0, seed=5)] * 3000

    def draw() -> list[int]:
        gen = torch.Generator().manual_seed(5)
        return Sampler()(logits, params, [gen] * 3000)

    first, second = draw(), draw()
    assert first == second
    freq = torch.bincount(torch.tensor(first), minlength=3).float() / 3000
    assert torch.allclose(freq, probs, atol=0.03)


def test_temperature_sharpens() -> None:
    logits = torch.tensor([[1.0, 0.0]]).repeat(2000, 1)
    gens = [torch.Generator().manual_seed(i) for i in range(2000)]
    cold = Sampler()(logits, [SamplingParams(temperature=0.2)] * 2000, gens)
    assert sum(t == 0 for t in cold) / 2000 > 0.97  # p = 1 / (1 + e^-5) = 0.993


def test_logprobs_of_the_sampled_token_and_the_top_ones() -> None:
    from vlmserve.engine.sampler import token_logprobs

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    info = token_logprobs(logits, [1, 2], [2, None])
    expected = logits[0].log_softmax(-1)
    assert info[1] is None
    assert info[0] is not None and abs(info[0].logprob - float(expected[1])) < 1e-6
    assert info[0].rank == 2  # token 1 is the second most likely
    assert [t for t, _ in info[0].top] == [0, 1]
    assert abs(info[0].top[0][1] - float(expected[0])) < 1e-6
    zero = token_logprobs(logits, [3, 2], [0, 0])
    assert zero[0] is not None and zero[0].top == [] and zero[0].rank == 4


# -- top-k + top-p + temperature against the exact filtered distribution -------------------------

# Distinct logits, their order unrelated to the token ids.
LOGITS = [1.2, 3.0, -0.4, 2.2, 0.5, 2.6, 0.1, 1.9, 0.8, 1.5]
# (temperature, top_k, top_p), each where a wrong filter shows:
SAMPLING_GROUPS = [
    # top-k changes what top-p keeps: 3 tokens after the top 6 are renormalized, 4 when top-p
    # sees the whole distribution (top-p first, or top-p mass not renormalized).
    (0.7, 6, 0.8),
    # top-p alone at a high temperature: 4 tokens; 3 if the cut used the raw logits (temperature
    # after filtering) or dropped the token that crosses top_p.
    (1.6, 0, 0.6),
    # top-k alone at a low temperature: 3 tokens; a 4th with an off-by-one k.
    (0.5, 3, 1.0),
]


def filtered_softmax(logits: list[float], temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The distribution vLLM and transformers sample from: logits / temperature; the top_k
    largest (0: all); of those, renormalized, remove the smallest whose cumulative mass (from
    the smallest up) is <= 1 - top_p, never the largest; softmax over what is left."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    ascending = np.argsort(z)
    if top_k > 0:
        ascending = ascending[-top_k:]
    probs = np.exp(z[ascending] - z[ascending].max())
    probs /= probs.sum()
    removed = np.cumsum(probs) <= 1 - top_p
    removed[-1] = False
    kept = ascending[~removed]
    out = np.zeros(len(z))
    out[kept] = np.exp(z[kept] - z[kept].max())
    return out / out.sum()


def test_top_k_top_p_temperature_samples_follow_the_filtered_softmax() -> None:
    assert [np.count_nonzero(filtered_softmax(LOGITS, *g)) for g in SAMPLING_GROUPS] == [3, 4, 3]
    assert np.count_nonzero(filtered_softmax(LOGITS, 0.7, 0, 0.8)) == 4  # top-k matters in group 0
    rows = 6_000  # per group, interleaved in one batch: each row must use its own parameters
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in SAMPLING_GROUPS] * rows
    logits = torch.tensor(LOGITS).repeat(len(params), 1)
    generator = torch.Generator().manual_seed(20240611)
    tokens = np.array(Sampler()(logits, params, [generator] * len(params)))
    # Bernstein's inequality for a count of `rows` Bernoulli(p) draws, P(|count - rows p| >= t)
    # <= 2 exp(-t^2 / (2 (rows p (1 - p) + t / 3))), with a union bound over every token of
    # every group: a correct sampler fails this with probability below 1e-9 (and, seeded, never).
    vocab, groups = len(LOGITS), len(SAMPLING_GROUPS)
    log_term = math.log(2 * vocab * groups / 1e-9)
    for g, group in enumerate(SAMPLING_GROUPS):
        expected = filtered_softmax(LOGITS, *group)
        counts = np.bincount(tokens[g::groups], minlength=vocab)
        assert counts[expected == 0].sum() == 0, (group, counts)  # nothing outside the filtered set
        variance = rows * expected * (1 - expected)
        bound = log_term / 3 + np.sqrt(log_term**2 / 9 + 2 * log_term * variance)
        assert (np.abs(counts - rows * expected) <= bound).all(), (group, counts, rows * expected, bound)


# -- penalties, masks and bias ----------------------------------------------------------------

from vlmserve.engine.sampler import TokenHistory  # noqa: E402


def reference_penalties(logits: list[float], tokens: list[int], num_prompt: int, p: SamplingParams) -> list[float]:
    """One row, one token at a time: transformers' repetition rule over the distinct tokens of
    prompt and output, then OpenAI's frequency and presence over the output."""
    out = list(logits)
    for t in set(tokens):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    output = tokens[num_prompt:]
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


def test_penalties_per_row_as_the_reference_and_rows_without_them_untouched() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, generator=gen) * 3
    rows = [
        (SamplingParams(temperature=0, repetition_penalty=1.3), [1, 2, 2, 5, 7, 7, 7], 3),
        (SamplingParams(temperature=0), [0, 1, 2, 3], 2),  # no penalty: the row stays as it is
        (SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=-0.25), [4, 4, 9, 9, 9, 4], 2),
        (SamplingParams(temperature=0, repetition_penalty=0.7, frequency_penalty=1.0), [3, 11, 11], 1),
    ]
    params = [p for p, _, _ in rows]
    histories = [TokenHistory(ids, n) for _, ids, n in rows]
    before = logits.clone()
    out = Sampler.process(logits, params, histories)
    assert torch.equal(logits, before)  # the input (raw logits, for logprobs) is not changed
    for i, (p, ids, n) in enumerate(rows):
        expected = torch.tensor(reference_penalties(before[i].tolist(), ids, n, p))
        assert torch.allclose(out[i], expected, rtol=1e-6, atol=1e-6), i
    # Row 2, output [9, 9, 9, 4]: token 9 three times, token 4 once (the prompt's two do not count).
    assert abs(float(before[2, 9] - out[2, 9]) - (0.5 * 3 - 0.25)) < 1e-6
    assert abs(float(before[2, 4] - out[2, 4]) - (0.5 * 1 - 0.25)) < 1e-6


def test_nothing_to_apply_returns_the_logits_as_they_are() -> None:
    logits = torch.randn(3, 10)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=3), SamplingParams(min_p=0.1)]
    assert Sampler.process(logits, params, None) is logits


def test_greedy_picks_the_argmax_after_the_penalty() -> None:
    logits = torch.tensor([[2.0, 1.95, -1.0]])
    history = TokenHistory([0, 0], 1)
    assert Sampler()(logits, [SamplingParams(temperature=0)], [None], [history]) == [0]
    assert Sampler()(logits, [SamplingParams(temperature=0, repetition_penalty=1.05)], [None], [history]) == [1]


def test_logit_bias_adds_and_min_tokens_masks_stop_tokens_until_reached() -> None:
    logits = torch.zeros(3, 6)
    params = [
        SamplingParams(temperature=0, logit_bias={2: 5.0, 4: -100.0}),
        SamplingParams(temperature=0, min_tokens=3),
        SamplingParams(temperature=0, min_tokens=3),
    ]
    histories = [
        TokenHistory([1, 1], 1),
        TokenHistory([1, 1, 1], 1, stop_token_ids=[0, 5, 999]),  # 2 output tokens < 3: masked; 999 past vocab
        TokenHistory([1, 1, 1, 1], 1, stop_token_ids=[0, 5]),  # 3 output tokens: free
    ]
    out = Sampler.process(logits, params, histories)
    assert out[0].tolist() == [0.0, 0.0, 5.0, 0.0, -100.0, 0.0]
    assert out[1].tolist() == [float("-inf"), 0.0, 0.0, 0.0, 0.0, float("-inf")]
    assert out[2].tolist() == [0.0] * 6


def test_allowed_token_ids_mask_every_other_token_of_their_row_only() -> None:
    logits = torch.arange(18, dtype=torch.float32).reshape(3, 6)
    params = [
        SamplingParams(temperature=0, allowed_token_ids=[1, 3]),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, allowed_token_ids=[0, 999], logit_bias={0: 1.0}),  # 999: past the vocabulary
    ]
    histories = [TokenHistory([1], 1)] * 3
    out = Sampler.process(logits, params, histories)
    inf = float("-inf")
    assert out[0].tolist() == [inf, 1.0, inf, 3.0, inf, inf]
    assert out[1].tolist() == logits[1].tolist()
    assert out[2].tolist() == [13.0, inf, inf, inf, inf, inf]  # masked, then biased
    assert Sampler()(logits, params, [None] * 3, histories) == [3, 5, 0]


def test_bad_words_mask_the_last_token_where_the_output_ends_with_the_rest() -> None:
    logits = torch.zeros(3, 8)
    words = [[5], [1, 2], [3, 4, 6]]
    params = [SamplingParams(temperature=0, bad_words_token_ids=words)] * 3
    histories = [
        TokenHistory([7, 1], 1),  # output [1]: bans 5 (one-token word) and 2 (after 1)
        TokenHistory([1, 3, 4], 1),  # the prompt's 1 does not count; output ends with 3, 4: bans 6
        TokenHistory([3, 4, 0], 2),  # output [0]; the prompt's 3, 4 do not count
    ]
    out = Sampler.process(logits, params, histories)
    assert torch.isinf(out).nonzero().tolist() == [[0, 2], [0, 5], [1, 5], [1, 6], [2, 5]]


def test_min_p_cuts_tokens_below_min_p_times_the_top_probability() -> None:
    from vlmserve.engine.sampler import apply_min_p

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = apply_min_p(logits, torch.tensor([0.5, 0.0]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False], [True] * 4]  # 0.15 < 0.25 <= 0.3
    draws = Sampler()(logits[:1].repeat(500, 1), [SamplingParams(min_p=0.5, seed=1)] * 500, [None] * 500)
    assert set(draws) == {0, 1}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("min_p", 1.5),
        ("min_tokens", -1),
        ("min_tokens", 2**63),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {3: float("inf")}),
        ("logit_bias", {3: 1e39}),  # infinite in float32
        ("bad_words", ["  "]),
        ("bad_words_token_ids", [[]]),
        ("logprobs", -2),
        ("prompt_logprobs", -2),
        ("prompt_logprobs", 2**63),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [3, -1]),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_min_tokens_may_not_exceed_max_tokens() -> None:
    with pytest.raises(ValueError, match="min_tokens must be at most max_tokens=4"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=10).min_tokens == 10


# -- greedy tokens straight from bf16 logits (kernels/cpu_linear.c's argmax) -------------------

from vlmserve.engine.sampler import greedy_tokens  # noqa: E402
from vlmserve.kernels.cpu import load_cpu_kernels  # noqa: E402

cpu_kernels = load_cpu_kernels()
needs_cpu_kernels = pytest.mark.skipif(cpu_kernels is None, reason="the CPU kernels need AVX2 and a C compiler")


@needs_cpu_kernels
@pytest.mark.parametrize(("rows", "vocab"), [(1, 151936), (5, 100), (3, 7), (32, 1000)])  # tails past 16, < 16
def test_bf16_argmax_is_torchs_argmax_of_the_widened_logits(rows: int, vocab: int) -> None:
    assert cpu_kernels is not None
    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 3).bfloat16()
    # bf16 has few values: ties between the largest, where the first index wins
    logits[:, vocab // 2] = logits.max(dim=-1).values
    assert cpu_kernels.argmax(logits) == logits.float().argmax(dim=-1).tolist()
    assert cpu_kernels.argmax(logits[:, ::2]) == logits[:, ::2].float().argmax(dim=-1).tolist()  # strided


@needs_cpu_kernels
def test_bf16_argmax_orders_special_values_as_torch() -> None:
    assert cpu_kernels is not None
    inf, nan = float("inf"), float("nan")
    rows = [
        [1.0, -0.0, 3.0, 3.0, 2.0] + [0.0] * 20,  # a tie: the first
        [-inf] * 25,  # nothing but -inf: index 0
        [-0.0, 0.0, -1.0] + [-2.0] * 22,  # -0 and +0 are equal: the first
        [-5.0] * 24 + [-4.0],  # the largest in the tail past 16
        [1.0, inf, 2.0, nan] + [0.0] * 21,  # NaN above +inf
        [-3.0] * 18 + [-1.0, -2.5] + [-3.0] * 5,  # all negative
    ]
    logits = torch.tensor(rows).bfloat16()
    logits[5, 10] = -torch.tensor(nan).bfloat16()  # a NaN with the sign bit set
    assert cpu_kernels.argmax(logits) == logits.float().argmax(dim=-1).tolist() == [2, 0, 0, 24, 3, 10]


@needs_cpu_kernels
def test_greedy_tokens_only_for_plain_greedy_bf16_rows() -> None:
    logits = torch.randn(3, 50).bfloat16()
    plain = SamplingParams(temperature=0)
    assert greedy_tokens(logits, [plain] * 3) == logits.float().argmax(dim=-1).tolist()
    assert greedy_tokens(logits.float(), [plain] * 3) is None  # fp32 logits: the sampler
    for other in (
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0, repetition_penalty=1.2),
        SamplingParams(temperature=0, logit_bias={3: 5.0}),
        SamplingParams(temperature=0, min_tokens=4),
        SamplingParams(temperature=0, bad_words_token_ids=[[7]]),
        SamplingParams(temperature=0, allowed_token_ids=[1, 2]),
    ):
        assert greedy_tokens(logits, [plain, other, plain]) is None, other
