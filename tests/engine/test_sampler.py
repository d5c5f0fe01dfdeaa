from __future__ import annotations

import math

import numpy as np
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
