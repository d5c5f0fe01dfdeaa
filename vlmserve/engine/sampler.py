"""Token sampling, in vLLM's order: the grammar mask of structured outputs; allowed_token_ids,
bad words, min_tokens and logit_bias masks; the penalties (repetition over prompt and output,
frequency and presence over the output); then greedy argmax, or temperature, min_p, top-k and
top-p and a draw, with a generator per seeded request so its samples do not depend on what else
is in the batch.

Each stage is one batched tensor operation over the rows that use it (a Python loop per row only
gathers the ids to mask), and is skipped when no row in the batch uses it. The penalties are
recomputed every step from each row's token ids, padded into one [rows, max_len] tensor: the
logits of those tokens are gathered, penalized and scattered back (docs/benchmarks.md, "Sampling
penalties", measures this against whole-vocabulary arithmetic on kept per-request counts): no
state to keep across steps, preemptions or a failed step."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from vlmserve.engine.contracts import TokenLogprobs
from vlmserve.engine.structured_output import apply_token_bitmask
from vlmserve.kernels.cpu import load_cpu_kernels
from vlmserve.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [b, vocab]; top_k [b] (0 = off); top_p [b] (1 = off). Cut tokens get -inf."""
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    cut = torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


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


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> torch.Tensor:
    """logits [b, vocab], one SamplingParams and history per row -> new penalized logits [b, vocab].
    Repetition: transformers' rule over the distinct tokens of prompt and output. Frequency and
    presence: OpenAI's, over the output. Only the logits of tokens in a row's history are read
    and written (gather, scatter): [b, longest] work, not [b, vocab]."""
    b, vocab = logits.shape
    device = logits.device
    longest = max(len(h.token_ids) for h in histories)
    # [b, longest] token ids, padded with `vocab`: a column added here and cut off at the end.
    padded = torch.tensor([h.token_ids + [vocab] * (longest - len(h.token_ids)) for h in histories], device=device)
    work = torch.nn.functional.pad(logits, (0, 1))  # [b, vocab + 1], a copy
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    seen = work.gather(1, padded)  # [b, longest]
    # Divided, not multiplied by the reciprocal: bit for bit as transformers. A token seen twice
    # is written twice with the same value: penalized once.
    work.scatter_(1, padded, torch.where(seen > 0, seen / repetition, seen * repetition))
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        num_prompt = torch.tensor([h.num_prompt_tokens for h in histories], device=device)
        is_output = torch.arange(longest, device=device)[None, :] >= num_prompt[:, None]  # [b, longest]
        output_ids = padded.masked_fill(~is_output, vocab)
        counts = torch.zeros(b, vocab + 1, device=device).scatter_add_(
            1, output_ids, torch.ones_like(work[:, :1]).expand_as(output_ids).contiguous()
        )
        count = counts.gather(1, output_ids)  # [b, longest]: times each output token occurs
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        values = work.gather(1, output_ids) - (frequency * count + presence)
        work.scatter_(1, output_ids, values)
    return work[:, :vocab]


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
) -> torch.Tensor:
    """allowed_token_ids (every other token -inf), bad words and min_tokens (-inf), then
    logit_bias (added), in place, one tensor operation each."""
    vocab = logits.shape[-1]
    allowing = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if allowing:
        # [rows, vocab] True where a row may not go; cleared at each row's allowed ids.
        blocked = torch.ones(len(allowing), vocab, dtype=torch.bool, device=logits.device)
        pairs = [(j, t) for j, i in enumerate(allowing) for t in params[i].allowed_token_ids or () if t < vocab]
        at = torch.tensor(pairs, dtype=torch.long, device=logits.device).reshape(-1, 2)  # [pairs, 2]
        blocked[at[:, 0], at[:, 1]] = False
        allowing_rows = torch.tensor(allowing, device=logits.device)
        logits[allowing_rows] = logits[allowing_rows].masked_fill(blocked, float("-inf"))
    rows: list[int] = []
    tokens: list[int] = []
    for i, (p, h) in enumerate(zip(params, histories, strict=True)):
        if p.bad_words_token_ids or p.min_tokens:
            banned = [t for t in _banned(p, h) if t < vocab]  # a stop id may lie past the vocabulary
            rows.extend([i] * len(banned))
            tokens.extend(banned)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=logits.device))
    rows, tokens, biases = [], [], []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            if token < vocab:  # the front end refuses ids past the vocabulary
                rows.append(i)
                tokens.append(token)
                biases.append(bias)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        logits.index_put_(index, torch.tensor(biases, device=logits.device), accumulate=True)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [b, vocab] (after temperature); min_p [b] (0 = off). Tokens less likely than min_p
    times the most likely one get -inf."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _masks(p: SamplingParams) -> bool:
    """Whether the row's logits get masks or a bias (Sampler._process)."""
    return bool(p.logit_bias or p.min_tokens or p.bad_words_token_ids or p.allowed_token_ids)


def greedy_tokens(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[int] | None:
    """The tokens of a step whose rows are all plain greedy (no masks, bias, penalties or logprobs;
    the caller has no grammar) straight from bf16 CPU logits: the CPU kernels' argmax, torch's
    argmax of the widened logits without the widening (1.2 + 2.2 ms over [32, 151936] on the
    Zen 4 machine). None where it does not apply: the caller samples as usual."""
    if logits.dtype != torch.bfloat16 or logits.device.type != "cpu" or logits.dim() != 2:
        return None
    if not all(p.greedy and p.logprobs is None and not _masks(p) and not p.needs_penalties for p in params):
        return None
    kernels = load_cpu_kernels()
    return None if kernels is None else kernels.argmax(logits)


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: Sequence[TokenHistory] | None = None,
        grammar: GrammarMask | None = None,
    ) -> list[int]:
        """logits [b, vocab] float32 (not modified) -> one token id per row. histories: each
        row's tokens so far, needed by the penalties, min_tokens and bad words; grammar: the
        structured outputs' masks."""
        assert logits.shape[0] == len(params) == len(generators)
        assert histories is None or len(histories) == len(params)
        logits = self.process(logits, params, histories, grammar)
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return greedy.tolist()
        rows = torch.tensor(random_rows, device=logits.device)
        temperature = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
        top_k = torch.tensor([max(params[i].top_k, 0) for i in random_rows], device=logits.device)
        top_p = torch.tensor([params[i].top_p for i in random_rows], device=logits.device)
        min_p = torch.tensor([params[i].min_p for i in random_rows], device=logits.device)
        scaled = logits[rows] / temperature[:, None]
        if bool((min_p > 0).any()):
            scaled = apply_min_p(scaled, min_p)
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        tokens = greedy.tolist()
        for j, i in enumerate(random_rows):
            # Generators live on the CPU; sample there so seeded runs agree across devices.
            tokens[i] = int(torch.multinomial(probs[j].cpu(), 1, generator=generators[i]))
        return tokens

    @staticmethod
    def process(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[TokenHistory] | None,
        grammar: GrammarMask | None = None,
    ) -> torch.Tensor:
        """The logits every draw starts from: grammar mask, masks, bias and penalties applied (a
        new tensor when any is; the input as is when none)."""
        if grammar is not None and grammar.rows:
            logits = logits.clone()
            apply_token_bitmask(logits, grammar.bitmask, grammar.rows)
            processed = Sampler._process(logits, params, histories)
            # A bad word may forbid the only token the grammar allows: the grammar wins there.
            rows = torch.tensor(grammar.rows)
            dead = rows[processed[rows].amax(dim=-1) == float("-inf")]
            if len(dead):
                processed = processed if processed is not logits else processed.clone()
                processed[dead] = logits[dead]
            return processed
        return Sampler._process(logits, params, histories)

    @staticmethod
    def _process(
        logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory] | None
    ) -> torch.Tensor:
        masked = [i for i, p in enumerate(params) if _masks(p)]
        penalized = [i for i, p in enumerate(params) if p.needs_penalties]
        if not masked and not penalized:
            return logits
        if histories is None:
            raise ValueError("penalties, min_tokens and bad words need each row's token history")
        if masked:
            logits = apply_masks_and_bias(logits.clone(), params, histories)
        if len(penalized) == len(params):
            logits = apply_penalties(logits, params, histories)  # a new tensor
        elif penalized:
            rows = torch.tensor(penalized, device=logits.device)
            logits = logits if masked else logits.clone()
            logits[rows] = apply_penalties(
                logits[rows], [params[i] for i in penalized], [histories[i] for i in penalized]
            )
        return logits
