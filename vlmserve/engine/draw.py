"""The draw of the sampled rows of a step: temperature, min_p, top-k and top-p turned into one
threshold per row, then one uniform number per row turned into a token by the inverse of the
cumulative distribution of the tokens kept. Batched over rows; no sort of the vocabulary where a
partial selection decides the cut, and one random number per row instead of one per token.

Why one threshold per row: every filter keeps each token at least as likely as one it keeps, so
together they keep exactly the tokens whose logit (divided by the temperature) is at least some
value. In that scaled space, with z0 the row's largest value:
- min_p keeps z >= z0 + ln(min_p) (a probability at least min_p times the largest);
- top-k keeps z >= the k-th largest value (tokens tied with it stay, as in transformers'
  TopKLogitsWarper and vLLM's top-k);
- top-p, over what those two keep and renormalised, keeps the smallest prefix in descending order
  whose mass reaches top_p (the largest always stays), and every token tied with its last one.

Where the work goes: a row with a top-k or top-p cut takes its K largest logits by torch.topk (a
partial selection: K in the tens costs about one argmax over the row) and decides its cut and its
draw on those [rows, K] candidates. A cut that the candidates cannot decide (top-p over a flat
distribution whose nucleus is wider than K, or ties running past the K-th) sends that row to
4,096 candidates, then to a full sort of its vocabulary: the same code on more of its tokens,
exact, slower. A row with no top-k or top-p cut (temperature alone, or with min_p) draws over the
whole vocabulary: each token's weight exp(z - z0) in place, 128 block sums to pick the block its
uniform falls in, then that block's own cumulative sum.

The draw: token i of the kept set is taken when u * total falls in (cdf[i-1], cdf[i]], u in
(0, 1] from float64 uniforms and the cumulative sums in float64, so a token of zero weight is never
taken and each token's chance is its weight over the total to within float64 rounding. The
exponential race (argmax of probs / Exp(1) noise) needs a random number per token: torch's
exponential_ over [32, 151936] took ~70 ms on the development CPU against ~1 ms for the softmax."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vlmserve.engine.structured_output import apply_token_bitmask
from vlmserve.kernels.cpu import load_cpu_kernels
from vlmserve.sampling_params import SamplingParams

# Candidates taken past the largest top_k of a step, so that tokens tied with the k-th largest
# (bf16 logits have few distinct values) are among them; more ties than this: a full sort.
TIE_MARGIN = 16
# Candidates for a top-p cut without top-k: the nucleus of a trained model at its sampling
# temperature is usually well inside this; a wider one takes WIDE_CANDIDATES, then a full sort.
TOP_P_CANDIDATES = 256
# The next candidates for rows the first ones did not decide, before a full sort.
WIDE_CANDIDATES = 4096
# Past this share of the vocabulary a partial selection costs about what a sort does.
MAX_CANDIDATE_SHARE = 8
# Rows a [rows, vocab] temporary holds at a time (8 x 151,936 fp32: 4.9 MB, reused by malloc).
ROWS_AT_A_TIME = 8
# Blocks of the whole-vocabulary draw.
NUM_BLOCKS = 128


@dataclass
class RowParams:
    """The draw's parameters of r rows, each a [r] tensor on the logits' device."""

    temperature: torch.Tensor  # float32, > 0
    top_k: torch.Tensor  # int64, 0: no cut (top_k off, or at least the vocabulary)
    top_p: torch.Tensor  # float32, 1: no cut
    min_p: torch.Tensor  # float32, 0: no cut

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device) -> RowParams:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([_top_k(p, vocab) for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
        )

    def select(self, rows: torch.Tensor) -> RowParams:
        return RowParams(self.temperature[rows], self.top_k[rows], self.top_p[rows], self.min_p[rows])


def _top_k(p: SamplingParams, vocab: int) -> int:
    return p.top_k if 0 < p.top_k < vocab else 0


def has_cut(p: SamplingParams, vocab: int) -> bool:
    """Whether the row is drawn with a top-k or top-p cut (else over the whole vocabulary)."""
    return bool(_top_k(p, vocab)) or p.top_p < 1.0


@dataclass
class RowMasks:
    """Structured outputs' masks of the rows a draw reads: bitmask [B, ceil(vocab / 32)] int32
    (xgrammar's layout: a set bit allows its token) and, for row i, its row in it (-1: none).
    Applied where the candidates are taken (the CPU top-k kernel skips what a mask forbids), so
    the logits themselves are never masked: no [rows, vocab] pass for it."""

    bitmask: torch.Tensor
    rows: list[int]

    def select(self, positions: list[int]) -> RowMasks:
        return RowMasks(self.bitmask, [self.rows[j] for j in positions])

    def apply(self, x: torch.Tensor) -> None:
        """x [len(rows), vocab] float32, in place: what each row's mask forbids gets -inf."""
        at = [i for i, row in enumerate(self.rows) if row >= 0]
        if at:
            index = torch.tensor([max(row, 0) for row in self.rows], device=self.bitmask.device)
            apply_token_bitmask(x, self.bitmask[index], at)


def largest(
    source: torch.Tensor, rows: list[int], k: int, masks: RowMasks | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of rows `rows` of source [R, vocab] (bf16 or fp32), descending, as
    fp32 [len(rows), k], and their token ids [len(rows), k]; with masks, of the tokens each row's
    mask allows (then -inf). On the CPU the CPU kernels' top-k (one pass over each row as it is;
    torch.topk needs the rows gathered and takes ~10x as long at k ~ 36), else torch.topk."""
    kernels = load_cpu_kernels() if source.device.type == "cpu" else None
    if kernels is not None and source.dtype in (torch.bfloat16, torch.float32) and source.stride(1) == 1:
        if masks is None:
            return kernels.topk(source, rows, k)
        return kernels.topk(source, rows, k, masks.bitmask.to(torch.int32).contiguous(), masks.rows)
    values, ids = _dense(source, rows, masks).topk(k, dim=-1)
    return values, ids


def argmax_rows(source: torch.Tensor, rows: list[int], masks: RowMasks | None = None) -> torch.Tensor:
    """[len(rows)] the first index of the largest value in each of `rows` of source [R, vocab] (a
    NaN the largest, as torch.argmax), among the tokens its mask allows."""
    return largest(source, rows, 1, masks)[1].squeeze(1)


def _gather_rows(source: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows `rows` of source: source itself where they are all of it, in order (else a copy)."""
    if rows == list(range(source.shape[0])):
        return source
    return source[torch.tensor(rows, device=source.device)]


def _dense(source: torch.Tensor, rows: list[int], masks: RowMasks | None) -> torch.Tensor:
    """Rows `rows` of source as float32, masked where masks say (a copy wherever a mask applies)."""
    x = _gather_rows(source, rows)
    if masks is None or all(row < 0 for row in masks.rows):
        return x.float()
    x = x.to(torch.float32, copy=True)
    masks.apply(x)
    return x


def draw_with_cut(
    source: torch.Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    u: torch.Tensor,
    masks: RowMasks | None = None,
) -> torch.Tensor:
    """Rows `rows` of source [R, vocab] (any float dtype: raw logits, or with masks and penalties
    applied; not changed), each with a top-k or top-p cut (its SamplingParams, temperature > 0),
    u [len(rows)] float64 in (0, 1], masks (for each of `rows`) -> [len(rows)] tokens: decided on
    each row's largest candidates where they suffice, on wider ones or a full sort where not."""
    vocab = source.shape[1]
    p = RowParams.of(params, vocab, source.device)
    # Each row's first candidates: past its top-k (ties), or top-p's; too many for a partial
    # selection to pay, and the row is sorted at once.
    first = [_top_k(q, vocab) + TIE_MARGIN if _top_k(q, vocab) else TOP_P_CANDIDATES for q in params]
    selected = [j for j, w in enumerate(first) if w * MAX_CANDIDATE_SHARE < vocab]
    sorted_now = [j for j, w in enumerate(first) if w * MAX_CANDIDATE_SHARE >= vocab]
    tokens = torch.empty(len(rows), dtype=torch.long, device=source.device)
    if selected:
        narrow = max(first[j] for j in selected)
        widths = [w for w in dict.fromkeys((narrow, max(narrow, WIDE_CANDIDATES))) if w * MAX_CANDIDATE_SHARE < vocab]
        pending = torch.tensor(selected, device=source.device)
        log_mass = None
        if any(not _top_k(params[j], vocab) for j in selected):
            # Rows without a top-k cut place their top-p cut against the mass of the whole row.
            log_mass = _log_mass(source, rows, p.temperature, masks)
        for width in widths:
            at = pending.tolist()
            chosen = [rows[j] for j in at]
            values, ids = largest(source, chosen, width, None if masks is None else masks.select(at))  # descending
            q = p.select(pending)
            z = values / q.temperature[:, None]
            threshold, decided = cut_threshold(z, q, None if log_mass is None else log_mass[pending], False)
            tokens[pending] = _draw_sorted(z, ids, threshold, u[pending])  # the undecided are drawn again
            pending = pending[~decided]  # NOTE: one device sync per width, not per row
            if not len(pending):
                break
        sorted_now += pending.tolist()
    if sorted_now:
        chosen = [rows[j] for j in sorted_now]
        values, ids = _sort_rows(_dense(source, chosen, None if masks is None else masks.select(sorted_now)))
        index = torch.tensor(sorted_now, device=source.device)
        q = p.select(index)
        z = values / q.temperature[:, None]
        threshold, _ = cut_threshold(z, q, None, complete=True)
        tokens[index] = _draw_sorted(z, ids, threshold, u[index])
    return tokens


def _log_mass(source: torch.Tensor, rows: list[int], temperature: torch.Tensor, masks: RowMasks | None) -> torch.Tensor:
    """[len(rows)] logsumexp of each row (masked) divided by its temperature, a few rows at a time
    (whole [rows, vocab] temporaries cost their page faults: ~5 ms each at 32 rows)."""
    out = torch.empty(len(rows), dtype=torch.float32, device=source.device)
    for start in range(0, len(rows), ROWS_AT_A_TIME):
        positions = list(range(start, min(start + ROWS_AT_A_TIME, len(rows))))
        chunk = _dense(source, [rows[j] for j in positions], None if masks is None else masks.select(positions))
        out[start : start + len(positions)] = (chunk / temperature[start : start + len(positions), None]).logsumexp(
            dim=-1
        )
    return out


def _sort_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token of each row, descending: the candidates of a cut that needs them all."""
    return x.sort(dim=-1, descending=True)


def cut_threshold(
    z: torch.Tensor, p: RowParams, log_mass: torch.Tensor | None, complete: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """z [r, k]: the k largest logits of each row divided by its temperature, descending
    (complete: the whole row) -> [r] the smallest value kept by min_p, top-k and top-p together,
    and [r] bool whether these candidates decided it (every kept token among them, the mass
    top-p is measured against known). log_mass [r]: logsumexp of the whole scaled row, the mass
    of rows without top-k or min_p when their kept set reaches past the candidates."""
    top = z[:, 0]
    threshold = top + torch.log(p.min_p)  # ln 0 = -inf: no min_p cut
    kth = z.gather(1, (p.top_k.clamp(min=1) - 1)[:, None]).squeeze(1)  # top_k <= k where set
    threshold = torch.where(p.top_k > 0, torch.maximum(threshold, kth), threshold)
    weights = torch.exp((z - top[:, None]).double()) * (z >= threshold[:, None])  # [r, k] relative to the top
    cumulative = weights.cumsum(dim=-1)
    # Every token past the candidates ranks at or below the last one: none of them counts where
    # that one is cut, or is -inf (a token masked out has no weight, kept or not).
    beyond_cut = torch.ones_like(top, dtype=torch.bool) if complete else z[:, -1] == float("-inf")
    # What min_p and top-k keep is all among the candidates unless the last candidate is kept.
    inside = beyond_cut | (z[:, -1] < threshold)
    mass, known = cumulative[:, -1], inside
    if log_mass is not None:
        whole_row = (p.top_k == 0) & (p.min_p == 0)
        mass = torch.where(whole_row, torch.exp(log_mass.double() - top.double()), mass)
        known = inside | whole_row
    # top-p: a token stays while the mass before it is under top_p of the whole, then every token
    # tied with the last one that stays.
    nucleus = ((cumulative - weights) < p.top_p.double()[:, None] * mass[:, None]) & (weights > 0)
    last = z.gather(1, (nucleus.sum(dim=-1).clamp(min=1) - 1)[:, None]).squeeze(1)  # the nucleus is a prefix
    threshold = torch.where(p.top_p < 1.0, torch.maximum(threshold, last), threshold)
    decided = known & (beyond_cut | (z[:, -1] < threshold))
    return threshold, decided


def _draw_sorted(z: torch.Tensor, ids: torch.Tensor, threshold: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """z [r, k] descending with their token ids [r, k], every kept token (z >= threshold [r]) among
    them -> [r] the token each row's u [r] picks."""
    weights = torch.exp((z - z[:, :1]).double()) * (z >= threshold[:, None])  # [r, k]
    cumulative = weights.cumsum(dim=-1)
    index = _search(cumulative, u * cumulative[:, -1])
    return ids.gather(1, index[:, None]).squeeze(1)


def _search(cumulative: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The first index whose cumulative weight reaches target [r] (0 < target <= the row's total:
    never a token of weight 0)."""
    index = torch.searchsorted(cumulative, target[:, None]).squeeze(1)
    return index.clamp(max=cumulative.shape[1] - 1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [b, vocab] (after temperature); min_p [b] (0 = off). Tokens less likely than min_p
    times the most likely one get -inf."""
    floor = logits.amax(dim=-1) + torch.log(min_p)
    return logits.masked_fill(logits < floor[:, None], float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [b, vocab] (after temperature); top_k [b] (0 = off); top_p [b] (1 = off) -> the
    logits with the tokens the draw cuts at -inf (a sort: for reading and tests, not the step)."""
    b, vocab = logits.shape
    ones = torch.ones(b, dtype=torch.float32, device=logits.device)
    p = RowParams(ones, torch.where(top_k < vocab, top_k, 0), top_p.float(), torch.zeros_like(ones))
    threshold, _ = cut_threshold(logits.sort(dim=-1, descending=True).values, p, None, complete=True)
    return logits.masked_fill(logits < threshold[:, None], float("-inf"))


def draw_whole_vocabulary(logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """logits [r, vocab] float32 (overwritten), rows without a top-k or top-p cut (temperature >
    0), u [r] float64 in (0, 1] -> [r] tokens drawn over every token min_p keeps."""
    r, vocab = logits.shape
    p = RowParams.of(params, vocab, logits.device)
    # In place: each token's weight relative to the row's most likely, exp((x - max) / T) in (0, 1].
    top = logits.amax(dim=-1, keepdim=True)
    weights = logits.sub_(top).div_(p.temperature[:, None]).exp_()
    for j, q in enumerate(params):
        if q.min_p > 0:  # min_p: at least min_p times the largest (threshold_ keeps what is above)
            below = float(np.nextafter(np.float32(q.min_p), np.float32(0.0)))  # the float32 just under it
            torch.nn.functional.threshold(weights[j], below, 0.0, inplace=True)
    # Block sums (NUM_BLOCKS of `size`, the last one short) pick the block, in float64.
    size = -(-vocab // NUM_BLOCKS)
    full = vocab // size
    sums = weights.new_zeros(r, full + (vocab > full * size))
    sums[:, :full] = weights[:, : full * size].view(r, full, size).sum(dim=-1)
    if full * size < vocab:
        sums[:, full] = weights[:, full * size :].sum(dim=-1)
    sums = sums.double()
    block_cumulative = sums.cumsum(dim=-1)  # [r, blocks]
    target = u * block_cumulative[:, -1]
    block = _search(block_cumulative, target)
    # Where in the block: the same fraction of the block's own float64 sum (the float32 block sum
    # and the float64 sum of its tokens differ by rounding; the fraction keeps the target inside
    # the block, so a token of weight 0 is never taken).
    block_sum = sums.gather(1, block[:, None]).squeeze(1)
    before = block_cumulative.gather(1, block[:, None]).squeeze(1) - block_sum
    fraction = ((target - before) / block_sum).clamp(0.0, 1.0)
    columns = block[:, None] * size + torch.arange(size, device=logits.device)  # [r, size]
    in_block = torch.where(columns < vocab, weights.gather(1, columns.clamp(max=vocab - 1)), 0.0).double()
    cumulative = in_block.cumsum(dim=-1)
    # A fraction rounded to 0 would find index 0 even at weight 0: the target stays above 0.
    offset = _search(cumulative, (fraction * cumulative[:, -1]).clamp(min=torch.finfo(torch.float64).tiny))
    return block * size + offset
