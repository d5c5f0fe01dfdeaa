"""Speculative decoding: drafted tokens checked by the model in the step that decodes.

A decoding request with k drafted tokens computes k + 1 tokens in one step (its last sampled
token and the drafts), sampled at every one of those rows: the sample at row j is kept, and the
next row looked at, while it equals draft j + 1; the first sample that differs (or the sample
after the last draft) ends the request's step. Every token that comes out was sampled from the
target model's distribution given the tokens before it, so the output is the one decoding gives:
token for token under greedy decoding, and in distribution under sampling. (With a draft that
is one token, not a distribution, this is rejection sampling: a draft d is kept with probability
p(d), and a rejected position's token comes from p without d, renormalised, which is what a
sample of p that is not d is.)

Where drafts come from (`speculative_config`, vLLM's names):
- "ngram" (prompt lookup): the last n tokens of the request (n from prompt_lookup_max down to
  prompt_lookup_min) found earlier in its prompt or output, the tokens that followed them there
  drafted. Positions of image and video placeholders never match.
- "mtp": a checkpoint's own multi-token-prediction head, run on the model's hidden states
  (Qwen3.5's published checkpoints carry one).

A draft costs a row in the step; where drafts keep being rejected, a request drafts fewer and
then, for a while that grows while they fail, none (DraftBackoff), so that speculation that does
not pay costs little."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

METHODS = ("ngram", "mtp")
# vLLM's bound on num_speculative_tokens is the model's; ours: past this a verify step is no
# longer near the cost of a decode step on any machine measured.
MAX_SPECULATIVE_TOKENS = 16
# vLLM's default n-gram window when neither bound is given.
DEFAULT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """vLLM's speculative_config dict -> the config (None: no speculation). ValueError naming
        the key that is wrong and what it may be."""
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {type(raw).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        unknown = sorted(set(raw) - known - {"model"})
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; this engine takes {sorted(known)}")
        method = raw.get("method")
        if method not in METHODS:
            hint = " (a draft model is not supported; use 'ngram' or 'mtp')" if raw.get("model") else ""
            raise ValueError(f"speculative_config: method must be one of {list(METHODS)}, got {method!r}{hint}")
        if raw.get("model") is not None:
            raise ValueError(f"speculative_config: method {method!r} takes no 'model' (drafts come from the target)")
        k = raw.get("num_speculative_tokens", 1 if method == "mtp" else None)
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            bound = MAX_SPECULATIVE_TOKENS
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in 1..{bound}, got {k!r}")
        if method == "mtp":
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if raw.get(key) is not None:
                    raise ValueError(f"speculative_config: {key} is for method 'ngram', not 'mtp'")
            return cls("mtp", k)
        low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        # vLLM's defaults: one bound given stands for both; neither: 5.
        low, high = (low if low is not None else high), (high if high is not None else low)
        low, high = (DEFAULT_LOOKUP if low is None else low), (DEFAULT_LOOKUP if high is None else high)
        for key, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"speculative_config: {key} must be a positive integer, got {value!r}")
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) is above prompt_lookup_max ({high})")
        return cls("ngram", k, low, high)

    def describe(self) -> str:
        if self.method == "ngram":
            window = f"{self.prompt_lookup_min}-{self.prompt_lookup_max}-token n-grams"
            return f"n-gram drafts ({window}), up to {self.num_speculative_tokens} a step"
        return f"the checkpoint's MTP head, up to {self.num_speculative_tokens} drafts a step"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class NgramIndex:
    """One request's tokens as an array the proposer searches (grown as tokens come; positions
    of image and video placeholders hold -1, which no token equals)."""

    def __init__(self, prompt_token_ids: Sequence[int], placeholder_spans: Sequence[tuple[int, int]]) -> None:
        self.tokens = np.empty(max(64, 2 * len(prompt_token_ids)), dtype=np.int64)
        self.length = 0
        self.extend(prompt_token_ids)
        for start, end in placeholder_spans:
            self.tokens[start:end] = -1

    def extend(self, token_ids: Sequence[int]) -> None:
        need = self.length + len(token_ids)
        if need > len(self.tokens):
            grown = np.empty(max(need, 2 * len(self.tokens)), dtype=np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : need] = token_ids
        self.length = need

    def propose(self, low: int, high: int, k: int) -> list[int]:
        """Up to k tokens that followed an earlier occurrence of the longest suffix of `low`..`high`
        tokens (none where no such suffix occurred before): the latest followed by k tokens, else
        the first (in a run that repeats, the latest is followed by the suffix alone)."""
        tokens = self.tokens[: self.length]
        n_max = min(high, self.length - 1)
        if n_max < low or k < 1:
            return []
        # Where the shortest suffix occurs (its last token's position, before the suffix itself),
        # then how far each occurrence also matches the tokens before it.
        last = tokens[-1]
        ends = np.flatnonzero(tokens[: self.length - 1] == last)
        if not len(ends):
            return []
        matched = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for back in range(1, n_max):
            at = ends - back
            ok = alive & (at >= 0)
            ok[ok] = tokens[at[ok]] == tokens[self.length - 1 - back]
            alive = ok
            if not alive.any():
                break
            matched[alive] += 1
        best = matched.max()
        if best < low:
            return []
        longest = ends[matched == best]
        whole = longest[longest + k < self.length]
        end = int(whole[-1] if len(whole) else longest[0])
        draft = tokens[end + 1 : min(end + 1 + k, self.length)]
        cut = np.flatnonzero(draft < 0)  # an image's placeholders: not text to draft
        return draft[: cut[0] if len(cut) else len(draft)].tolist()


class DraftBackoff:
    """How many tokens one request drafts next: the configured k while drafts are accepted;
    halved at each verification that accepts none, and at none, a pause of `pause` steps (four
    times longer at each pause that ends in another rejection, up to MAX_PAUSE) before one draft
    is tried again. Any accepted draft ends the pauses; every draft of a step accepted doubles the
    count. (Measured: a draft head that accepts nothing on Qwen3.5-2B cost 8 % of the speed with
    pauses doubling from 4; most of it the drafting steps' lm_head products.)"""

    MAX_PAUSE = 64
    FIRST_PAUSE = 4

    def __init__(self, k: int) -> None:
        self.k = k
        self.current = k
        self.pause = 0  # the length of the last pause
        self.waiting = 0  # steps left of the current pause

    def next_count(self) -> int:
        """Drafts to propose this step (0 while paused; counts the step)."""
        if self.waiting:
            self.waiting -= 1
            return 0
        return self.current

    def verified(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == 0:
            self.current //= 2
            if self.current == 0:
                self.pause = min(self.MAX_PAUSE, 4 * self.pause if self.pause else self.FIRST_PAUSE)
                self.waiting = self.pause
                self.current = 1
            return
        self.pause = 0
        if accepted == drafted:
            self.current = min(self.k, 2 * self.current)
        else:
            self.current = max(self.current, min(self.k, accepted + 1))


def verify_drafts(samples: Sequence[int], drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """A step's samples, 1 + len(drafts[i]) rows for request i in order, each row sampled as if
    the drafts before it were the request's tokens -> each request's tokens: the drafts while each
    equals the sample of the row before it, then the first sample that differs (or the one after
    the last draft). Each row's sample must be drawn on its own (its own uniform number): that is
    what makes a kept draft and a replaced one come out with the target's probabilities."""
    out, row = [], 0
    for mine in drafts:
        accepted = 0
        while accepted < len(mine) and samples[row + accepted] == mine[accepted]:
            accepted += 1
        out.append(list(samples[row : row + accepted + 1]))
        row += len(mine) + 1
    assert row == len(samples), (row, len(samples))
    return out


@dataclass
class SpeculativeStats:
    """Drafts verified and accepted (vLLM's spec_decode counters): the verifications (num_drafts),
    the drafted tokens they checked, those accepted, and accepted per position (the i-th draft of
    a verification accepted: every draft before it was too)."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] | None = None

    @classmethod
    def empty(cls, config: SpeculativeConfig | None) -> SpeculativeStats:
        k = 0 if config is None else config.num_speculative_tokens
        return cls(k, accepted_per_position=[0] * k)

    def add(self, outputs: Sequence[Any]) -> None:
        """Outputs with num_draft_tokens and num_accepted_tokens (EngineCoreOutput)."""
        assert self.accepted_per_position is not None
        for output in outputs:
            if output.num_draft_tokens:
                self.num_drafts += 1
                self.num_draft_tokens += output.num_draft_tokens
                self.num_accepted_tokens += output.num_accepted_tokens
                for i in range(min(output.num_accepted_tokens, len(self.accepted_per_position))):
                    self.accepted_per_position[i] += 1

    def since(self, earlier: SpeculativeStats) -> SpeculativeStats:
        """What was counted after `earlier` (a copy taken then): self less earlier."""
        assert self.accepted_per_position is not None and earlier.accepted_per_position is not None
        return SpeculativeStats(
            self.num_speculative_tokens,
            self.num_drafts - earlier.num_drafts,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            [a - b for a, b in zip(self.accepted_per_position, earlier.accepted_per_position, strict=True)],
        )

    def copy(self) -> SpeculativeStats:
        return replace(self, accepted_per_position=list(self.accepted_per_position or ()))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification yields on average: 1 + its accepted drafts (vLLM's measure)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
