"""What a step does to the logits before the draw, in vLLM's order, in place on the sampler's own
float32 copy: the grammar mask of structured outputs; allowed_token_ids, bad words and min_tokens
(-inf) and logit_bias (added); then the repetition, frequency and presence penalties.

No [rows, vocab] temporary is made (each one is ~19 MB at batch 32 over Qwen's 151,936 tokens,
and a fresh one costs its page faults, ~5 ms, every step): every stage reads and writes only the
logits of the tokens it concerns, by flat index, in the rows that use it. The penalties are
recomputed every step from each row's token ids (no state across steps, preemptions or a failed
step): one gather and one scatter over the rows' histories padded into one [rows, longest]
tensor."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vlmserve.engine.structured_output import apply_token_bitmask
from vlmserve.sampling_params import SamplingParams


@dataclass
class GrammarMask:
    """Structured outputs' masks of one step: bitmask [b, ceil(vocab / 32)] int32 (bit set: the
    grammar allows the token), applied to `rows` only."""

    bitmask: torch.Tensor
    rows: list[int]


@dataclass
class TokenHistory:
    """A row's tokens so far, for the penalties, min_tokens and bad words."""

    token_ids: list[int]  # prompt, then output (read only)
    num_prompt_tokens: int
    # What min_tokens holds back: eos ids and the request's stop_token_ids.
    stop_token_ids: Collection[int] = ()

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def has_masks(p: SamplingParams) -> bool:
    """Whether the row's logits get masks or a bias."""
    return bool(p.logit_bias or p.min_tokens or p.bad_words_token_ids or p.allowed_token_ids)


def anything_to_apply(params: Sequence[SamplingParams], grammar: GrammarMask | None) -> bool:
    return bool(grammar is not None and grammar.rows) or any(has_masks(p) or p.needs_penalties for p in params)


def apply_in_place(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory] | None,
    grammar: GrammarMask | None,
    unmasked: Callable[[list[int]], torch.Tensor] | None = None,
) -> None:
    """logits [b, vocab] float32, changed in place. unmasked: rows -> those rows of the logits
    before anything was applied (any dtype; default: from a copy kept here), for a row where a
    bad word forbids the only token its grammar allows: the grammar wins there."""
    masked = [i for i, p in enumerate(params) if has_masks(p)]
    penalized = [i for i, p in enumerate(params) if p.needs_penalties]
    if (masked or penalized) and histories is None:
        raise ValueError("penalties, min_tokens and bad words need each row's token history")
    grammar_rows = grammar.rows if grammar is not None else []
    if grammar_rows and unmasked is None and masked:
        copy = logits.clone()
        unmasked = copy.__getitem__
    if grammar is not None and grammar_rows:
        apply_token_bitmask(logits, grammar.bitmask, grammar_rows)
    if masked:
        assert histories is not None
        apply_masks_and_bias(logits, params, histories)
    if penalized:
        assert histories is not None
        penalized = [i for i in penalized if histories[i].token_ids]  # nothing to penalize in an empty one
    if penalized:
        assert histories is not None
        apply_penalties(logits, [params[i] for i in penalized], [histories[i] for i in penalized], penalized)
    if grammar is not None and grammar_rows and masked:
        rows = torch.tensor(grammar_rows, device=logits.device)
        dead = rows[logits.amax(dim=-1)[rows] == float("-inf")].tolist()
        if dead:
            assert unmasked is not None
            logits[dead] = unmasked(dead).float()
            apply_token_bitmask(logits, grammar.bitmask, dead)


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory], rows: Sequence[int]
) -> None:
    """logits [b, vocab] float32, in place: in each of `rows` (one SamplingParams and a non-empty
    history each), transformers' repetition rule over the distinct tokens of prompt and output,
    then OpenAI's frequency and presence over the output. Only the logits of tokens in a row's
    history are read and written: [rows, longest] work, not [rows, vocab]."""
    vocab = logits.shape[1]
    device = logits.device
    flat = logits.view(-1)
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        # Each row padded with its own last token: a token it has, written again with its value.
        at = _flat_ids([h.token_ids for h in histories], rows, vocab, device)  # [p, longest]
        seen = flat[at]
        penalty = torch.tensor(repetition, device=device)[:, None]
        # Divided, not multiplied by the reciprocal: bit for bit as transformers. Every position
        # of one token writes the same value: a token seen twice is penalized once.
        flat[at] = torch.where(seen > 0, seen / penalty, seen * penalty)
    with_output = [
        j
        for j, (p, h) in enumerate(zip(params, histories, strict=True))
        if h.num_output_tokens and (p.frequency_penalty or p.presence_penalty)
    ]
    if with_output:
        # Each row's output sorted: a token's count is the length of its run.
        outputs = [sorted(histories[j].token_ids[histories[j].num_prompt_tokens :]) for j in with_output]
        at = _flat_ids(outputs, [rows[j] for j in with_output], vocab, device)  # [q, longest output]
        starts = torch.ones_like(at, dtype=torch.bool)
        starts[:, 1:] = at[:, 1:] != at[:, :-1]
        run = starts.cumsum(dim=-1) - 1  # [q, L] the run each position is in
        # Padding repeats the row's last token and extends its run: only real positions count.
        length = torch.tensor([len(o) for o in outputs], device=device)[:, None]
        real = (torch.arange(at.shape[1], device=device)[None, :] < length).long()
        count = torch.zeros_like(at).scatter_add_(1, run, real).gather(1, run)  # [q, L] times in the output
        frequency = torch.tensor([params[j].frequency_penalty for j in with_output], device=device)[:, None]
        presence = torch.tensor([params[j].presence_penalty for j in with_output], device=device)[:, None]
        flat[at] = flat[at] - (frequency * count + presence)


def _flat_ids(token_ids: Sequence[list[int]], rows: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(rows), longest] flat indices into [b, vocab] logits of each row's tokens, each padded
    with its own last token (numpy builds the array: torch.tensor of nested lists took ~5x as
    long)."""
    longest = max(len(t) for t in token_ids)
    ids = np.array([t + t[-1:] * (longest - len(t)) for t in token_ids], dtype=np.int64)
    return torch.from_numpy(ids).to(device) + torch.tensor(rows, device=device)[:, None] * vocab


def _banned(params: SamplingParams, history: TokenHistory) -> list[int]:
    """Tokens this row may not take now: each bad word's last token where the output ends with
    the rest of it, and the stop tokens while min_tokens is not reached."""
    banned: list[int] = []
    if params.bad_words_token_ids:
        output = history.token_ids[history.num_prompt_tokens :]
        for word in params.bad_words_token_ids:
            prefix = len(word) - 1
            if prefix <= len(output) and output[len(output) - prefix :] == word[:prefix]:
                banned.append(word[-1])
    if history.num_output_tokens < params.min_tokens:
        banned.extend(history.stop_token_ids)
    return banned


def apply_masks_and_bias(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> None:
    """allowed_token_ids (every other token -inf), bad words and min_tokens (-inf), then
    logit_bias (added), in place, one tensor operation each."""
    vocab = logits.shape[-1]
    device = logits.device
    allowing = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if allowing:
        pairs = [(i, t) for i in allowing for t in params[i].allowed_token_ids or () if t < vocab]
        at = torch.tensor(pairs, dtype=torch.long, device=device).reshape(-1, 2)  # [pairs, 2]
        kept = logits[at[:, 0], at[:, 1]]
        logits.index_fill_(0, torch.tensor(allowing, device=device), float("-inf"))
        logits[at[:, 0], at[:, 1]] = kept
    rows: list[int] = []
    tokens: list[int] = []
    for i, (p, h) in enumerate(zip(params, histories, strict=True)):
        if p.bad_words_token_ids or p.min_tokens:
            banned = [t for t in _banned(p, h) if t < vocab]  # a stop id may lie past the vocabulary
            rows.extend([i] * len(banned))
            tokens.extend(banned)
    if rows:
        index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=device))
    rows, tokens, biases = [], [], []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            if token < vocab:  # the front end refuses ids past the vocabulary
                rows.append(i)
                tokens.append(token)
                biases.append(bias)
    if rows:
        index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
        logits.index_put_(index, torch.tensor(biases, device=device), accumulate=True)
