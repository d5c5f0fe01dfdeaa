"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's log-probability given the
tokens before it, with the most likely tokens at its position.

They come from the hidden states the prefill computes anyway: a step's rows whose next token is
a prompt token go through the LM head (only for requests that asked, a bounded number of rows at
a time, so a long chunk never holds [chunk, vocab] logits at once). Each request keeps one entry
per prompt position in the model runner, filled chunk by chunk (a position computed again after
a preemption or a failed step is overwritten with the same value) and sent once, with the first
sampled token. A request asking for them never starts from the prefix cache (the scheduler skips
it, as vLLM does): every prompt row is computed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vlmserve.engine.sampler import token_logprobs
from vlmserve.ipc.contracts import TokenLogprobs

# Rows put through the LM head at once: [ROWS_PER_PASS, vocab] float32 logits at most.
ROWS_PER_PASS = 64


@dataclass
class PromptLogprobsRows:
    """One step's prompt rows that asked for logprobs: where each lands and what it scores."""

    rows: list[int] = field(default_factory=list)  # rows of the step's hidden states
    targets: list[int] = field(default_factory=list)  # the prompt token that follows each row
    counts: list[int] = field(default_factory=list)  # top tokens wanted (-1: the vocabulary)
    # (the request's buffer, the prompt position) of each row
    places: list[tuple[list[TokenLogprobs | None], int]] = field(default_factory=list)

    def add(
        self, buffer: list[TokenLogprobs | None], token_ids: list[int], start: int, end: int, base: int, count: int
    ) -> None:
        """Positions [start, end) of a prompt computed this step from row `base` on: those whose
        next token is still in the prompt (buffer holds one entry per such position)."""
        for t in range(start, min(end, len(buffer))):
            self.rows.append(base + t - start)
            self.targets.append(token_ids[t + 1])
            self.counts.append(count)
            self.places.append((buffer, t))

    def compute(
        self, hidden: torch.Tensor, rows: list[int], compute_logits: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """hidden: the step's hidden states, where self.rows are `rows` (the forward may return
        only the rows the step uses). Fills the buffers."""
        for lo in range(0, len(rows), ROWS_PER_PASS):
            hi = lo + ROWS_PER_PASS
            logits = compute_logits(hidden[rows[lo:hi]]).float()  # [<= ROWS_PER_PASS, vocab]
            infos = token_logprobs(logits, self.targets[lo:hi], list(self.counts[lo:hi]))
            for (buffer, t), info in zip(self.places[lo:hi], infos, strict=True):
                buffer[t] = info


def new_buffer(num_prompt_tokens: int) -> list[TokenLogprobs | None]:
    """One entry per prompt token after the first (None until computed)."""
    return [None] * max(0, num_prompt_tokens - 1)


def finished_buffer(buffer: list[TokenLogprobs | None]) -> list[TokenLogprobs]:
    missing = [t for t, info in enumerate(buffer) if info is None]
    assert not missing, f"prompt logprobs of positions {missing[:8]} were never computed"
    return [info for info in buffer if info is not None]
