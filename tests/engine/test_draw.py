"""The batched draw (engine/draw.py) against the exact filtered distribution, on each of its paths:
top-k candidates, top-p decided on candidates, top-p sent to a full sort, the whole vocabulary
by blocks, min_p; ties at the cut; seeded rows independent of their batch; top_k 1 the argmax."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vlmserve.engine import draw as draw_module
from vlmserve.engine.draw import draw_whole_vocabulary, draw_with_cut, has_cut
from vlmserve.engine.sampler import Sampler, TokenHistory, greedy_tokens
from vlmserve.sampling_params import SamplingParams

VOCAB = 3001  # past 8 x (top-p's 256 candidates): the partial selection runs; blocks of 24, the last one short

# A head of 12 tokens (ties at 2.5 and at 1.5) at scattered ids, the last id among them, and a
# tail of low logits on a 0.25 grid (many ties) holding ~30 % of the mass at temperature 1.
HEAD = {17: 3.0, 2900: 2.5, 5: 2.5, 1200: 2.2, 3000: 2.0, 44: 1.5, 45: 1.5, 2047: 1.5, 999: 1.0, 0: 0.5, 1500: 0.0}


def draw(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """One row's draw, by the path the sampler takes for it (the whole-vocabulary one overwrites
    the logits)."""
    if has_cut(params[0], logits.shape[1]):
        return draw_with_cut(logits, [0], params, u)
    return draw_whole_vocabulary(logits, params, u)


def row_logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    tail = -3.0 - torch.randint(0, 13, (VOCAB,), generator=g).float() * 0.25
    for token, value in HEAD.items():
        tail[token] = value
    return tail


def reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The distribution vLLM and transformers sample from, in float64, each cut as a threshold on
    the scaled logits: min_p (z >= max + ln min_p), top-k (z >= the k-th largest: ties stay, as
    transformers' TopKLogitsWarper), then top-p over what they keep, renormalised (the smallest
    prefix by descending z whose mass reaches top_p, never empty, and every token tied with
    its last)."""
    z = logits.astype(np.float64) / temperature
    keep = np.isfinite(z)
    if min_p > 0:
        keep &= z >= z.max() + math.log(min_p)
    if top_k > 0:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    if top_p < 1:
        w = np.where(keep, np.exp(z - z.max()), 0.0)
        w /= w.sum()
        order = np.argsort(-z, kind="stable")
        before = np.cumsum(w[order]) - w[order]
        stays = (before < top_p) & (w[order] > 0)
        keep &= z >= z[order][stays.sum() - 1]
    out = np.where(keep, np.exp(z - z.max()), 0.0)
    return out / out.sum()


def assert_follows(tokens: np.ndarray, expected: np.ndarray, what: object, groups: int) -> None:
    """Bernstein's inequality per token count, a union bound over every token of every group: a
    correct sampler fails with probability below 1e-9 (and, seeded, never)."""
    rows = len(tokens)
    counts = np.bincount(tokens, minlength=len(expected))
    assert counts[expected == 0].sum() == 0, (what, np.flatnonzero(counts * (expected == 0)))
    log_term = math.log(2 * len(expected) * groups / 1e-9)
    variance = rows * expected * (1 - expected)
    bound = log_term / 3 + np.sqrt(log_term**2 / 9 + 2 * log_term * variance)
    worst = np.argmax(np.abs(counts - rows * expected) - bound)
    assert (np.abs(counts - rows * expected) <= bound).all(), (what, worst, counts[worst], rows * expected[worst])


# (temperature, top_k, top_p, min_p): one group per path of the draw.
GROUPS = [
    (0.7, 6, 1.0, 0.0),  # top-k candidates; the 6th (1.5) is tied with the 7th and 8th: 8 tokens
    (1.3, 6, 0.7, 0.05),  # top-k, then min_p, then top-p, on candidates
    (0.8, 0, 0.5, 0.0),  # top-p alone, decided on its 256 candidates
    (1.0, 0, 0.97, 0.0),  # top-p alone past the candidates: a full sort of the row
    (1.0, 0, 1.0, 0.0),  # the whole vocabulary, by blocks
    (0.6, 0, 1.0, 0.02),  # the whole vocabulary above min_p
    (0.9, 2995, 0.9, 0.0),  # a top-k too wide for a partial selection: sorted
    # min_p keeps ~900 tokens, past the candidates, and cuts the rest of the tail: top-p's mass is
    # not the whole row's, so the row is sorted (the whole row's mass would keep 2 more tokens)
    (1.0, 0, 0.6, 0.001),
]


@pytest.fixture(params=["cpu kernels", "torch"])
def candidates_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The candidates from the CPU kernels' top-k (where they load) or from torch.topk."""
    if request.param == "torch":
        monkeypatch.setattr(draw_module, "load_cpu_kernels", lambda: None)
    elif draw_module.load_cpu_kernels() is None:
        pytest.skip("the CPU kernels need AVX2 and a C compiler")
    return str(request.param)


def test_every_path_of_the_draw_follows_the_filtered_distribution(candidates_by: str) -> None:
    rows = 3000  # per group, interleaved in one batch: each row must use its own parameters
    logits = row_logits()
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in GROUPS] * rows
    generator = torch.Generator().manual_seed(20261128)
    tokens = np.array(Sampler()(logits.repeat(len(params), 1), params, [generator] * len(params)))
    for g, group in enumerate(GROUPS):
        expected = reference(logits.numpy(), *group)
        assert_follows(tokens[g :: len(GROUPS)], expected, group, len(GROUPS))
    # The groups differ where a wrong cut would show: ties kept (8 tokens, not 6), min_p and
    # top-p cutting inside top-k, a nucleus that is not the whole vocabulary.
    sizes = [int(np.count_nonzero(reference(logits.numpy(), *group))) for group in GROUPS]
    assert sizes[0] == 8 and sizes[1] < 8 and sizes[2] < 12 < sizes[3] < VOCAB == sizes[4] and sizes[5] < VOCAB


def test_each_path_is_the_one_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The groups above reach the paths they are named for: the full sort only where the
    candidates cannot decide the cut."""
    sorted_rows: list[int] = []
    real = draw_module._sort_rows

    def spy(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sorted_rows.append(x.shape[0])
        return real(x)

    monkeypatch.setattr(draw_module, "_sort_rows", spy)
    logits = row_logits()[None]
    uniform = torch.ones(1, dtype=torch.float64)
    for group, sorts in zip(GROUPS, [0, 0, 0, 1, 0, 0, 1, 1], strict=True):
        sorted_rows.clear()
        t, k, p, m = group
        draw(logits, [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)], uniform)
        assert len(sorted_rows) == sorts, group


def test_penalties_then_the_draw(candidates_by: str) -> None:
    """Repetition, presence and frequency penalties change the distribution the draw samples."""
    logits = row_logits()
    history = TokenHistory([17, 17, 5, 1200, 44], 2)  # prompt 17, 17; output 5, 1200, 44
    params = SamplingParams(
        temperature=0.9, top_k=8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3
    )
    rows = 6000
    generator = torch.Generator().manual_seed(3)
    tokens = np.array(Sampler()(logits.repeat(rows, 1), [params] * rows, [generator] * rows, [history] * rows))
    penalized = logits.numpy().astype(np.float64)
    for t in {17, 5, 1200, 44}:
        penalized[t] = penalized[t] / 1.3 if penalized[t] > 0 else penalized[t] * 1.3
    for t in (5, 1200, 44):
        penalized[t] -= 0.3 + 0.5
    assert_follows(tokens, reference(penalized, 0.9, 8, 1.0, 0.0), "penalties", 1)


@pytest.mark.parametrize(("candidates", "wide"), [(2, 4096), (2, 40), (256, 4096)])
def test_top_p_on_candidates_wider_ones_or_sorted_gives_the_same_distribution(
    monkeypatch: pytest.MonkeyPatch, candidates: int, wide: int
) -> None:
    """Decided on 2 candidates (never: the nucleus is ~6 tokens), on 40 after 2, on a full sort
    after 2 (40 x 8 < 3001 <= 4096 x 8), on 256."""
    monkeypatch.setattr(draw_module, "TOP_P_CANDIDATES", candidates)
    monkeypatch.setattr(draw_module, "WIDE_CANDIDATES", wide)
    logits = row_logits()
    rows = 4000
    params = [SamplingParams(temperature=0.8, top_p=0.6)] * rows
    generator = torch.Generator().manual_seed(11)
    tokens = np.array(Sampler()(logits.repeat(rows, 1), params, [generator] * rows))
    assert_follows(tokens, reference(logits.numpy(), 0.8, 0, 0.6, 0.0), (candidates, wide), 1)


def test_a_token_of_weight_zero_is_never_drawn_at_either_end_of_the_uniforms() -> None:
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, [3, 1000, 2999]] = torch.tensor([0.0, 1.0, -2.0])  # 2999: inside the short last block
    for params in (SamplingParams(), SamplingParams(top_k=5), SamplingParams(top_p=0.99)):
        for u in (1.0, 1e-300, 0.5):
            (token,) = draw(logits.clone(), [params], torch.tensor([u], dtype=torch.float64)).tolist()
            assert token in (3, 1000, 2999), (params, u, token)
    # u = 1 takes the last token of the kept set's order: the highest id over the whole
    # vocabulary, the least likely on candidates (sorted by logit).
    assert draw(logits.clone(), [SamplingParams()], torch.ones(1, dtype=torch.float64)).tolist() == [2999]
    assert draw(logits.clone(), [SamplingParams(top_k=5)], torch.ones(1, dtype=torch.float64)).tolist() == [2999]


def test_top_k_1_is_the_argmax_whatever_the_temperature() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, VOCAB, generator=g)
    logits[:, 100] = logits[:, 200] = logits.amax(dim=-1) + 0.01  # a tie at the top: the first index
    params = [SamplingParams(temperature=t, top_k=1, top_p=0.001) for t in (0.01, 1.0, 5.0, 50.0)] * 16
    generators = [torch.Generator().manual_seed(i) for i in range(64)]
    assert Sampler()(logits, params, generators) == [100] * 64
    # Qwen2-VL's published defaults take the bf16 argmax kernel's path too, when it is there.
    tokens = greedy_tokens(logits.bfloat16(), params)
    assert tokens is None or tokens == logits.bfloat16().float().argmax(dim=-1).tolist()


def test_a_seeded_row_draws_the_same_whatever_its_batch() -> None:
    logits = row_logits()
    seeded = SamplingParams(temperature=1.0, top_p=0.97, seed=5)  # a row that goes to the full sort
    others = [SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=1.0), SamplingParams(temperature=0)]

    def run(batch: list[SamplingParams]) -> list[int]:
        generator = torch.Generator().manual_seed(5)
        sampler, out = Sampler(), []
        for _ in range(20):
            rows = [seeded, *batch]
            tokens = sampler(logits.repeat(len(rows), 1), rows, [generator] + [None] * len(batch))
            out.append(tokens[0])
        return out

    alone = run([])
    assert run(others) == alone == run(others[::-1] * 3)
    assert len(set(alone)) > 5  # it samples


def test_unseeded_rows_draw_their_own_numbers() -> None:
    """Rows of one batch with the same logits and no seed are independent draws (one shared
    random number would give every row the same token)."""
    logits = row_logits()
    for params in (SamplingParams(temperature=1.0), SamplingParams(top_k=8), SamplingParams(top_p=0.97)):
        tokens = Sampler()(logits.repeat(64, 1), [params] * 64, [None] * 64)
        assert len(set(tokens)) > 3, params


def test_grammar_masks_on_every_path_follow_the_masked_distribution(candidates_by: str) -> None:
    """Structured outputs' masks go with the candidates of rows drawn with a cut and rows taking
    the argmax, and mask the logits of whole-vocabulary rows and of rows with bad words: each
    samples the distribution of its logits with the forbidden tokens at -inf."""
    from vlmserve.engine.sampler import GrammarMask

    logits = row_logits()
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[17, 5, 1200, 44, 45, 0, 1500, 3000]] = True  # not 2900 (2.5), 2047, 999
    allowed[torch.arange(100, 2000, 3)] = True  # some of the tail
    words = -(-VOCAB // 32)
    bits = torch.zeros(words * 32, dtype=torch.bool)
    bits[:VOCAB] = allowed
    packed = (bits.view(words, 32).long() << torch.arange(32)).sum(-1)
    row_mask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    groups = [(0.7, 6, 1.0, 0.0), (0.8, 0, 0.5, 0.0), (1.0, 0, 0.97, 0.0), (1.0, 0, 1.0, 0.0), (1.2, 5, 0.9, 0.0)]
    rows = 2500
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in groups] * rows
    # the last group also has a bad word it never meets (its output is empty): the masking path
    params[len(groups) - 1 :: len(groups)] = [
        SamplingParams(temperature=1.2, top_k=5, top_p=0.9, bad_words_token_ids=[[1, 2]])
    ] * rows
    histories = [TokenHistory([7], 1)] * len(params)
    grammar = GrammarMask(row_mask.repeat(len(params), 1), list(range(len(params))))
    generator = torch.Generator().manual_seed(5)
    batch = logits.repeat(len(params), 1)
    tokens = np.array(Sampler()(batch, params, [generator] * len(params), histories, grammar))
    masked = logits.masked_fill(~allowed, float("-inf")).numpy()
    for g, group in enumerate(groups):
        assert_follows(tokens[g :: len(groups)], reference(masked, *group), group, len(groups))
    greedy = Sampler()(
        logits[None].bfloat16(), [SamplingParams(temperature=0)], [None], None, GrammarMask(row_mask[None], [0])
    )
    assert greedy == [17] and masked.argmax() == 17
    two = logits.clone()
    two[17] = -5.0  # the largest allowed is now 5 (2.5), tied with 2900, which is not allowed
    assert Sampler()(two[None], [SamplingParams(temperature=0)], [None], None, GrammarMask(row_mask[None], [0])) == [5]
