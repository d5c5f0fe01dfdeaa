"""Structured outputs with xgrammar: a request's grammar (JSON schema, regex, choice, EBNF) is
compiled once per distinct spec, each request gets its own matcher in the engine core, and every
step the matchers of the requests sampled fill one token bitmask there, sent with the step (every
tensor-parallel rank applies the same one; vLLM's StructuredOutputManager); the sampler applies
it before anything else.

The engine process loads no tokenizer for its work; xgrammar needs the vocabulary as bytes, so
the first request with a grammar reads it through the family's tokenizer, once (about a second
for Qwen's 151k tokens on a small CPU), and never otherwise. Ids past the tokenizer's vocabulary
(the model pads its embedding to 151936) are never allowed. A matcher allows eos only where the
grammar may end; after the grammar ends it allows nothing but eos, so the request stops there.

A matcher holds what its request generated: a sampled token is accepted once the step that
sampled it has succeeded (a failed step leaves it as it was)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from vlmserve.kernels.cpu import load_cpu_kernels
from vlmserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # xgrammar is imported when the first grammar is compiled (it takes a second)
    import xgrammar


# Whitespace characters allowed between two JSON elements (vLLM leaves it unbounded: a model that
# falls into a whitespace loop then runs to max_tokens with an unfinished object). 32 still takes
# json.dumps(indent=2) output 15 levels deep.
MAX_JSON_WHITESPACE = 32


def _ebnf_choice(choice: list[str]) -> str:
    # EBNF string literals take JSON's escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


class GrammarCompiler:
    """Compiles StructuredOutputsParams into xgrammar grammars for this model's vocabulary,
    each distinct spec once (the cache is keyed by StructuredOutputsParams.key)."""

    def __init__(self, load_vocabulary: Callable[[], list[bytes]], model_vocab_size: int, eos_token_ids: Sequence[int]):
        self._load_vocabulary = load_vocabulary
        self.model_vocab_size = model_vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiled: dict[tuple[str, str, bool], xgrammar.CompiledGrammar] = {}
        self._lock = threading.Lock()

    def _xgr_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import xgrammar

            vocab = self._load_vocabulary()
            if len(vocab) > self.model_vocab_size:
                vocab = vocab[: self.model_vocab_size]  # tokens the model cannot produce
            info = xgrammar.TokenizerInfo(
                vocab,
                xgrammar.VocabType.RAW,  # the bytes each token stands for, already decoded
                vocab_size=self.model_vocab_size,
                stop_token_ids=self.eos_token_ids,
            )
            # A compile runs between steps, on the engine's threads: as many as torch's (two
            # threads compiled 32 JSON schemas in 0.94 s against 1.32 s on one, on 2 cores).
            threads = max(1, torch.get_num_threads())
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec` (cached). ValueError names what is wrong with it."""
        key = spec.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                return compiled
            compiler = self._xgr_compiler()
            kind, text, any_whitespace = key
            try:
                if kind in ("json", "json_object"):
                    schema = '{"type": "object"}' if kind == "json_object" else text
                    json.loads(schema)  # a clear message for text that is not JSON at all
                    compiled = compiler.compile_json_schema(
                        schema,
                        any_whitespace=any_whitespace,
                        max_whitespace_cnt=MAX_JSON_WHITESPACE if any_whitespace else None,
                    )
                elif kind == "regex":
                    compiled = compiler.compile_regex(text)
                elif kind == "choice":
                    compiled = compiler.compile_grammar(_ebnf_choice(json.loads(text)))
                else:
                    compiled = compiler.compile_grammar(text)
            except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses with its parser's message
                what = {"json": "JSON schema", "json_object": "JSON schema"}.get(kind, kind)
                message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ValueError(f"structured_outputs: the {what} could not be compiled: {message}") from None
            self._compiled[key] = compiled
            return compiled

    def matcher(self, spec: StructuredOutputsParams, output_token_ids: Sequence[int] = ()) -> GrammarState:
        """A fresh matcher for `spec` that has accepted `output_token_ids`."""
        import xgrammar

        state = GrammarState(xgrammar.GrammarMatcher(self.compile(spec)))
        for token in output_token_ids:
            state.accept(token)
        return state


class GrammarState:
    """One request's matcher and how many of its output tokens it has taken."""

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self.matcher = matcher
        self.num_accepted = 0

    def accept(self, token_id: int) -> None:
        # A token the mask allowed is accepted; after the grammar ended (eos taken, and the request
        # went on under ignore_eos) the matcher takes nothing more and the mask is no longer applied.
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token_id)
        self.num_accepted += 1

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class TokenBitmask:
    """One step's [rows, ceil(vocab / 32)] int32 bitmask, in a buffer reused across steps."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._buffer: torch.Tensor | None = None

    def fill(self, states: Sequence[GrammarState | None]) -> tuple[torch.Tensor, list[int]]:
        """Row i: the tokens states[i] allows next; a row without a grammar (None) or whose grammar
        ended is left out. Returns the bitmask [len(states), words] (a view of the buffer) and the
        rows to apply it to."""
        import xgrammar

        if self._buffer is None or self._buffer.shape[0] < len(states):
            self._buffer = xgrammar.allocate_token_bitmask(max(len(states), 8), self.vocab_size)
        rows = [i for i, s in enumerate(states) if s is not None and not s.terminated]
        for i in rows:
            state = states[i]
            assert state is not None
            state.matcher.fill_next_token_bitmask(self._buffer, i)
        return self._buffer[: len(states)], rows


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits [b, vocab] float32, in place: in each of `rows`, tokens whose bit in the same row
    of bitmask [b, ceil(vocab / 32)] is 0 get -inf (the CPU kernels' pass, which skips words
    allowing all 32 tokens, where they load: ~30x xgrammar's CPU kernel; else xgrammar's)."""
    assert bitmask.shape[0] == logits.shape[0] and bitmask.shape[1] * 32 >= logits.shape[1], (
        bitmask.shape,
        logits.shape,
    )
    if not rows:
        return
    kernels = load_cpu_kernels() if logits.device.type == "cpu" else None
    if kernels is not None and logits.dtype == torch.float32 and logits.stride(1) == 1:
        kernels.apply_bitmask(logits, rows, bitmask.to(torch.int32).contiguous(), rows)
        return
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[1], indices=rows)


class StructuredOutputs:
    """The matchers of the engine core's requests with structured outputs (request id -> its
    matcher), and each step's bitmask."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.matchers: dict[str, GrammarState] = {}
        self.bitmask = TokenBitmask(compiler.model_vocab_size)

    def add(self, request_id: str, matcher: GrammarState) -> None:
        """A new request's matcher (GrammarCompiler.matcher)."""
        self.matchers[request_id] = matcher

    def fill(self, sampled: list[str]) -> tuple[list[str], torch.Tensor | None]:
        """The requests among `sampled` (request ids) whose grammar goes on, and their masks
        [rows, words] int32 (a copy: it travels with the step); ([], None) for none."""
        live = [r for r in sampled if r in self.matchers and not self.matchers[r].terminated]
        if not live:
            return [], None
        bitmask, rows = self.bitmask.fill([self.matchers[r] for r in live])
        assert rows == list(range(len(live)))
        return live, bitmask.clone()

    def accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Tokens a step that succeeded sampled for the request (nothing for one without a grammar)."""
        state = self.matchers.get(request_id)
        if state is not None:
            for token in token_ids:
                state.accept(token)

    def remove(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.matchers.pop(request_id, None)
