from __future__ import annotations

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
