"""Sampling parameters with vLLM's names, defaults and meaning.

How the sampler applies them, in vLLM's order: bad words, min_tokens and logit_bias first; then the
penalties (repetition over prompt and output, frequency and presence over the output); then greedy
argmax, or temperature, min_p, top-k and top-p before drawing."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field, replace
from typing import Any

_GREEDY_EPS = 1e-5
# vLLM's default --max-logprobs: the most logprobs or prompt_logprobs a request may ask for
# (-1, the whole vocabulary, only where the engine's max_logprobs is -1 too).
MAX_LOGPROBS = 20
# repetition_penalty's range: far enough from 0 that logit / penalty stays finite in float32.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6
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
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one of json (a JSON schema, as a dict or its JSON
    text), regex, choice (the output is one of these strings), grammar (EBNF, xgrammar's dialect
    of GBNF) or json_object (any JSON object). Plain data: the engine compiles it."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON without whitespace between its tokens (vLLM's flag; whitespace is allowed by default).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                f"got {given or 'none'}"
            )
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json, ensure_ascii=False)  # plain text from here on
        if self.json is not None and not isinstance(self.json, str):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty EBNF grammar")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, spec text, any whitespace): what a compiled grammar is cached by."""
        if self.json is not None:
            return ("json", str(self.json), not self.disable_any_whitespace)
        if self.regex is not None:
            return ("regex", self.regex, False)
        if self.choice is not None:
            return ("choice", json.dumps(self.choice, ensure_ascii=False), False)
        if self.grammar is not None:
            return ("grammar", self.grammar, False)
        return ("json_object", "", not self.disable_any_whitespace)


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
    # Log-probabilities of the sampled token plus this many most likely ones (None: none; -1:
    # the whole vocabulary). The engine's max_logprobs bounds it (Frontend.resolve_params).
    logprobs: int | None = None
    # Each prompt token's log-probability given the tokens before it, plus this many most likely
    # ones at each position (None: none; -1: the whole vocabulary). Bounded as logprobs.
    prompt_logprobs: int | None = None
    # Only these tokens may be sampled (vLLM's allow-list; None: all).
    allowed_token_ids: list[int] | None = None
    # transformers' rule over the distinct tokens of prompt and output: logit / p if > 0, else logit * p.
    repetition_penalty: float = 1.0
    # OpenAI's: logit -= presence_penalty (token in the output) + frequency_penalty * (times in the output).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Tokens with probability below min_p times the most likely token's are cut (after temperature).
    min_p: float = 0.0
    # Token id -> added to its logit.
    logit_bias: dict[int, float] | None = None
    # eos and stop tokens are masked (and stop strings not looked for) until this many tokens.
    min_tokens: int = 0
    # Words never generated: the last token of each is masked where the output ends with the rest.
    bad_words: list[str] | None = None
    # bad_words as token ids (filled in by the front end's tokenizer; with and without a leading space).
    bad_words_token_ids: list[list[int]] | None = None
    # The output follows this grammar (JSON schema, regex, choice, EBNF): masked token by token.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: the prompt cut to its last N tokens before it runs (-1: max_model_len); applied
    # where the prompt is processed (the offline LLM), not by the engine.
    truncate_prompt_tokens: int | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_strings = tuple(stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}

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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int64(value) or value < -1):
                raise ValueError(f"{name} must be -1 (the whole vocabulary) or an integer >= 0, got {value!r}")
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list)
            or not self.allowed_token_ids
            or not all(is_int64(t) and t >= 0 for t in self.allowed_token_ids)
        ):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids (integers >= 0)")
        if self.stop_token_ids is not None and not all(is_int64(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of integers in 0 .. 2**63 - 1")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not real(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        p = self.repetition_penalty
        if not real(p) or not MIN_REPETITION_PENALTY <= p <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                f"(1 = off), got {p!r}"
            )
        if not real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not is_int64(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0 (at most 2**63 - 1), got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logit_bias is not None and (
            not isinstance(self.logit_bias, dict)
            or not all(
                is_int64(k) and k >= 0 and real(v) and math.isfinite(as_float32(v)) for k, v in self.logit_bias.items()
            )
        ):
            raise ValueError("logit_bias must map token ids (integers >= 0) to numbers finite in float32")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            raise ValueError("bad_words must be a list of words (non-blank strings)")
        if self.bad_words_token_ids is not None and not all(
            isinstance(ids, list) and ids and all(is_int64(t) and t >= 0 for t in ids)
            for ids in self.bad_words_token_ids
        ):
            raise ValueError("bad_words_token_ids must be a list of non-empty lists of token ids")
        t = self.truncate_prompt_tokens
        if t is not None and (not is_int64(t) or t == 0 or t < -1):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {t!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams")
            if self.min_tokens:
                # The grammar may allow only eos where min_tokens forbids it: nothing left to draw.
                raise ValueError("min_tokens cannot be combined with structured_outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def takes_argmax(self) -> bool:
        """Greedy, or a top-k of 1: the most likely token whatever the temperature (what
        transformers gives for Qwen2-VL's published top_k 1)."""
        return self.greedy or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def for_child(self, index: int) -> SamplingParams:
        """The parameters of the index-th of n samples: n=1, and a distinct seed when seeded."""
        # Wrapped into int64 (two's complement, as torch maps seeds) so a child's seed stays valid.
        seed = None if self.seed is None else (self.seed + index - INT64_MIN) % 2**64 + INT64_MIN
        return replace(self, n=1, seed=seed, stop=list(self.stop_strings))
