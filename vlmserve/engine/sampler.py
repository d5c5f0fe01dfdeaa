"""Token sampling: greedy, or temperature then top-k then top-p, with a generator per seeded
request so its samples do not depend on what else is in the batch."""

from __future__ import annotations

import torch

from vlmserve.engine.contracts import TokenLogprobs
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
    """Per row, for rows whose count is not None (vLLM's default: raw logits, before
    temperature and top-k/top-p)."""
    rows = [i for i, c in enumerate(counts) if c is not None]
    out: list[TokenLogprobs | None] = [None] * len(counts)
    if not rows:
        return out
    logprobs = logits[rows].float().log_softmax(dim=-1)
    k = max(counts[i] or 0 for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1)  # k == 0 gives empty tensors
    for j, i in enumerate(rows):
        chosen = logprobs[j, tokens[i]]
        rank = int((logprobs[j] > chosen).sum()) + 1
        n = counts[i] or 0
        top = list(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist(), strict=True))
        out[i] = TokenLogprobs(float(chosen), rank, top)
    return out


class Sampler:
    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> list[int]:
        """logits [b, vocab] float32 -> one token id per row."""
        assert logits.shape[0] == len(params) == len(generators)
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return greedy.tolist()
        rows = torch.tensor(random_rows, device=logits.device)
        temperature = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
        top_k = torch.tensor([max(params[i].top_k, 0) for i in random_rows], device=logits.device)
        top_p = torch.tensor([params[i].top_p for i in random_rows], device=logits.device)
        scaled = logits[rows] / temperature[:, None]
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        tokens = greedy.tolist()
        for j, i in enumerate(random_rows):
            # Generators live on the CPU; sample there so seeded runs agree across devices.
            tokens[i] = int(torch.multinomial(probs[j].cpu(), 1, generator=generators[i]))
        return tokens
