"""Sampling parameters with vLLM's names and defaults."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, replace
from typing import Any

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
# What the engine can represent: integers go to torch and msgpack as int64, floats to float32.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32 (subnormals may flush to 0)


def is_int64(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and INT64_MIN <= x <= INT64_MAX


def as_float32(x: float) -> float:
    """x rounded to float32 (inf past its range, nan stays nan)."""
    try:
        return float(struct.unpack("f", struct.pack("f", x))[0])
    except OverflowError:
        return math.copysign(math.inf, x)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    max_tokens: int | None = 16  # None: up to max_model_len
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Log-probabilities of the sampled token plus this many most likely ones (None: none).
    logprobs: int | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_strings = tuple(stop)
        self.stop_token_ids = list(self.stop_token_ids or [])

    def _validate(self) -> None:
        """Every numeric field within what the engine represents (int64, float32), so that no
        value reaching the sampler can make it raise."""

        def real(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if not is_int64(self.n) or self.n < 1:
            raise ValueError(f"n must be a positive integer (at most 2**63 - 1), got {self.n!r}")
        if not real(self.temperature) or not 0.0 <= as_float32(self.temperature) < math.inf:
            raise ValueError(f"temperature must be a number >= 0 that is finite in float32, got {self.temperature!r}")
        if not real(self.top_p) or not 0.0 < self.top_p <= 1.0 or as_float32(self.top_p) < FLOAT32_TINY:
            raise ValueError(
                f"top_p must be in (0, 1] and at least {FLOAT32_TINY:.3g} (the smallest normal float32), "
                f"got {self.top_p!r}"
            )
        if not is_int64(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or a positive integer (at most 2**63 - 1), got {self.top_k!r}"
            )
        if self.max_tokens is not None and (not is_int64(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer (at most 2**63 - 1), got {self.max_tokens!r}")
        if self.seed is not None and not is_int64(self.seed):
            raise ValueError(f"seed must be an integer in -2**63 .. 2**63 - 1, got {self.seed!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if self.logprobs is not None and (not is_int64(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in 0..{MAX_LOGPROBS}, got {self.logprobs!r}")
        if self.stop_token_ids is not None and not all(is_int64(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of integers in 0 .. 2**63 - 1")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def for_child(self, index: int) -> SamplingParams:
        """The parameters of the index-th of n samples: n=1, and a distinct seed when seeded."""
        # Wrapped into int64 (two's complement, as torch maps seeds) so a child's seed stays valid.
        seed = None if self.seed is None else (self.seed + index - INT64_MIN) % 2**64 + INT64_MIN
        return replace(self, n=1, seed=seed, stop=list(self.stop_strings))
