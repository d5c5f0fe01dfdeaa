"""Token sampling, in vLLM's order: the grammar mask, masks, bias and penalties
(engine/logits_processors.py); then the argmax (greedy rows, and top_k 1 whatever the
temperature), or temperature, min_p, top-k and top-p and a draw (engine/draw.py: one threshold and
one uniform number per row), with a generator per seeded request so its samples do not depend on
what else is in the batch.

A step's logits are copied once into the sampler's own float32 buffer, kept from step to step (a
fresh [rows, vocab] tensor costs its page faults every step), rows grouped by what they need:
those drawn with a top-k or top-p cut, then those drawn over the whole vocabulary, then those that
take the argmax; every stage then works in place on a slice of it. A step whose rows all take the
plain argmax of bf16 CPU logits never copies them: the CPU kernels' argmax reads them as they are."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vlmserve.engine.draw import RowMasks, argmax_rows, draw_whole_vocabulary, draw_with_cut, has_cut
from vlmserve.engine.draw import apply_min_p as apply_min_p
from vlmserve.engine.draw import apply_top_k_top_p as apply_top_k_top_p
from vlmserve.engine.logits_processors import GrammarMask as GrammarMask
from vlmserve.engine.logits_processors import TokenHistory as TokenHistory
from vlmserve.engine.logits_processors import anything_to_apply, apply_in_place, has_masks
from vlmserve.ipc.contracts import TokenLogprobs
from vlmserve.kernels.cpu import load_cpu_kernels
from vlmserve.sampling_params import SamplingParams


def token_logprobs(logits: torch.Tensor, tokens: list[int], counts: list[int | None]) -> list[TokenLogprobs | None]:
    """Per row, for rows whose count is not None (-1: the whole vocabulary; vLLM's default: raw
    logits, before temperature and top-k/top-p)."""
    rows = [i for i, c in enumerate(counts) if c is not None]
    out: list[TokenLogprobs | None] = [None] * len(counts)
    if not rows:
        return out
    logprobs = logits[rows].float().log_softmax(dim=-1)
    vocab = logprobs.shape[-1]
    wanted = [min(vocab, vocab if counts[i] == -1 else counts[i] or 0) for i in rows]
    top_values, top_ids = logprobs.topk(max(wanted), dim=-1)  # k == 0 gives empty tensors
    for j, i in enumerate(rows):
        chosen = logprobs[j, tokens[i]]
        rank = int((logprobs[j] > chosen).sum()) + 1
        n = wanted[j]
        top = list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist(), strict=True))
        out[i] = TokenLogprobs(float(chosen), rank, top)
    return out


def greedy_tokens(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[int] | None:
    """The tokens of a step whose rows all take the argmax (greedy, or top_k 1) with nothing
    else to apply (no masks, bias, penalties or logprobs; the caller has no grammar), straight
    from bf16 CPU logits: the CPU kernels' argmax, torch's argmax of the widened logits without
    the widening (1.2 + 2.2 ms over [32, 151936] on the Zen 4 machine). None where it does not
    apply: the caller samples as usual."""
    if logits.dtype != torch.bfloat16 or logits.device.type != "cpu" or logits.dim() != 2:
        return None
    if not all(p.takes_argmax and p.logprobs is None and not has_masks(p) and not p.needs_penalties for p in params):
        return None
    kernels = load_cpu_kernels()
    return None if kernels is None else kernels.argmax(logits)


def uniforms(generators: Sequence[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """[r] float64 in (0, 1], one per row: a seeded row's from its own generator (so its samples do
    not depend on the batch around it), every other row's from torch's default generator in one
    call. One call per distinct generator, in row order."""
    u = torch.empty(len(generators), dtype=torch.float64)
    by_generator: dict[int, tuple[torch.Generator | None, list[int]]] = {}
    for i, generator in enumerate(generators):
        by_generator.setdefault(id(generator), (generator, []))[1].append(i)
    for generator, rows in by_generator.values():
        # Generators live on the CPU; drawn there so seeded runs agree across devices.
        u[rows] = torch.rand(len(rows), dtype=torch.float64, generator=generator)
    return (1.0 - u).to(device, non_blocking=True)  # [0, 1) -> (0, 1]: a token of weight 0 is never drawn


class Sampler:
    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None  # [rows, vocab] float32, grown as batches need

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: Sequence[TokenHistory] | None = None,
        grammar: GrammarMask | None = None,
    ) -> list[int]:
        """logits [b, vocab] (any float dtype; not modified) -> one token id per row. histories:
        each row's tokens so far, needed by the penalties, min_tokens and bad words; grammar: the
        structured outputs' masks."""
        b, vocab = logits.shape
        assert b == len(params) == len(generators)
        assert histories is None or len(histories) == len(params)
        if grammar is None:
            tokens = greedy_tokens(logits, params)
            if tokens is not None:
                return tokens
        # Rows by what they need, in this order from here on: a draw with a top-k or top-p cut, a
        # draw over the whole vocabulary, the argmax.
        cut = [i for i, p in enumerate(params) if not p.takes_argmax and has_cut(p, vocab)]
        whole = [i for i, p in enumerate(params) if not p.takes_argmax and not has_cut(p, vocab)]
        order = cut + whole + [i for i, p in enumerate(params) if p.takes_argmax]
        ordered = [params[i] for i in order]
        n_cut, n_random = len(cut), len(cut) + len(whole)
        # A grammar's mask goes with the candidates of a row drawn with a cut or taking the argmax
        # (no [rows, vocab] pass); the rest (the whole-vocabulary draw, a row whose bad words may
        # forbid what its grammar allows) mask the logits first.
        candidate_masks, grammar = _split_grammar(grammar, order, ordered, n_cut, n_random)
        if anything_to_apply(params, grammar):
            # Every row copied and processed, then read from the buffer.
            source = self._work(logits, order)
            apply_in_place(
                source,
                ordered,
                None if histories is None else [histories[i] for i in order],
                _reordered_grammar(grammar, order),
                lambda rows: logits[[order[j] for j in rows]],
            )
            rows = list(range(b))
            whole_logits = source[n_cut:n_random]
        else:
            # The raw logits read where they are; the whole-vocabulary rows copied (their draw
            # overwrites them).
            source, rows = logits, order
            whole_logits = self._work(logits, whole)
        drawn = torch.empty(b, dtype=torch.long, device=logits.device)
        u = uniforms([generators[i] for i in order[:n_random]], logits.device)
        if n_cut:
            masks = _part(candidate_masks, 0, n_cut)
            drawn[:n_cut] = draw_with_cut(source, rows[:n_cut], ordered[:n_cut], u[:n_cut], masks)
        if n_random > n_cut:
            drawn[n_cut:n_random] = draw_whole_vocabulary(whole_logits, ordered[n_cut:n_random], u[n_cut:])
        if n_random < b:
            drawn[n_random:] = argmax_rows(source, rows[n_random:], _part(candidate_masks, n_random, b))
        tokens = [0] * b
        for i, token in zip(order, drawn.tolist(), strict=True):
            tokens[i] = token
        return tokens

    def _work(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The sampler's float32 copy of rows `rows` of logits (its row j is logits[rows[j]]), in
        its buffer: a view, valid until the next call."""
        vocab = logits.shape[1]
        buffer = self._buffer
        if buffer is None or buffer.shape[0] < len(rows) or buffer.shape[1] != vocab or buffer.device != logits.device:
            buffer = self._buffer = torch.empty(len(rows), vocab, dtype=torch.float32, device=logits.device)
        work = buffer[: len(rows)]
        if rows == list(range(logits.shape[0])):
            work.copy_(logits)
        else:
            for j, i in enumerate(rows):
                work[j].copy_(logits[i])
        return work

    @staticmethod
    def process(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[TokenHistory] | None,
        grammar: GrammarMask | None = None,
    ) -> torch.Tensor:
        """The logits every draw starts from: grammar mask, masks, bias and penalties applied (a
        new tensor when any is; the input as is when none)."""
        if not anything_to_apply(params, grammar):
            return logits
        work = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
        apply_in_place(work, params, histories, grammar, lambda rows: logits[rows])
        return work


def _reordered_grammar(grammar: GrammarMask | None, order: list[int]) -> GrammarMask | None:
    """The grammar's masks for the rows in `order` (row j is row order[j])."""
    if grammar is None or order == list(range(len(order))):
        return grammar
    position = {i: j for j, i in enumerate(order)}
    index = torch.tensor(order, device=grammar.bitmask.device)
    return GrammarMask(grammar.bitmask[index], sorted(position[i] for i in grammar.rows))


def _split_grammar(
    grammar: GrammarMask | None, order: list[int], ordered: list[SamplingParams], n_cut: int, n_random: int
) -> tuple[RowMasks | None, GrammarMask | None]:
    """The grammar's rows whose mask goes with their candidates (rows in `order`'s positions; a
    row drawn with a cut or taking the argmax, without bad words or allowed_token_ids, which
    may forbid every token its grammar allows), and the grammar of the rest (original rows)."""
    if grammar is None or not grammar.rows:
        return None, grammar
    mine = set(grammar.rows)
    with_candidates = [-1] * len(order)
    rest = []
    for j, i in enumerate(order):
        if i not in mine:
            continue
        p = ordered[j]
        if (j < n_cut or j >= n_random) and not p.bad_words_token_ids and not p.allowed_token_ids:
            with_candidates[j] = i
        else:
            rest.append(i)
    masks = RowMasks(grammar.bitmask, with_candidates) if any(r >= 0 for r in with_candidates) else None
    return masks, GrammarMask(grammar.bitmask, sorted(rest)) if rest else None


def _part(masks: RowMasks | None, start: int, end: int) -> RowMasks | None:
    """The masks of rows [start, end) in the sampler's order (None where none applies)."""
    if masks is None or all(r < 0 for r in masks.rows[start:end]):
        return None
    return masks.select(list(range(start, end)))
