"""Structured outputs with xgrammar: a request's grammar (JSON schema, regex, choice, EBNF) is
compiled once per distinct spec, off the step loop (engine/grammar_compile.py), and held in a
cache bounded in bytes (engine/grammar_cache.py); each request gets its own matcher in the engine
core, and every step the matchers of the requests sampled fill one token bitmask there, sent with
the step (every tensor-parallel rank applies the same one; vLLM's StructuredOutputManager); the
sampler applies it before anything else. The ranks compile nothing and hold no grammar: the
engine core's one cache is all the grammar memory there is.

A request whose grammar is not compiled yet waits here, out of the scheduler, while the others
run; it is queued once its grammar is ready, or refused (take_refused()) when its spec does not
compile, when compiling it took more than max_grammar_compile_seconds of CPU, or when the compiled
grammar is larger than the whole cache.

The engine process loads no tokenizer for its work; xgrammar needs the vocabulary as bytes, so
the first request with a grammar reads it through the family's tokenizer, once (about a second
for Qwen's 151k tokens on a small CPU), and never otherwise. Ids past the tokenizer's vocabulary
(the model pads its embedding to 151936) are never allowed. A matcher allows eos only where the
grammar may end; after the grammar ends it allows nothing but eos, so the request stops there.

A matcher holds what its request generated: a sampled token is accepted once the step that
sampled it has succeeded (a failed step leaves it as it was)."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from vlmserve.engine.grammar_cache import GrammarCache, GrammarKey
from vlmserve.engine.grammar_compile import CompileJob, CompileThreads
from vlmserve.engine.request import Request
from vlmserve.kernels.cpu import load_cpu_kernels
from vlmserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # xgrammar is imported when the first grammar is compiled (it takes a second)
    import xgrammar

logger = logging.getLogger(__name__)

# Whitespace characters allowed between two JSON elements (vLLM leaves it unbounded: a model that
# falls into a whitespace loop then runs to max_tokens with an unfinished object). 32 still takes
# json.dumps(indent=2) output 15 levels deep.
MAX_JSON_WHITESPACE = 32
# Grammars compiling at once. Two: one compile abandoned past its limit (it cannot be interrupted)
# still leaves a thread for the others.
COMPILE_THREADS = 2
# Specs whose compile passed the time limit lately (by hash), refused at once when asked for again:
# a client retrying one would otherwise hold a thread per try.
REMEMBER_TIMED_OUT = 256
MiB = 1 << 20


def _ebnf_choice(choice: list[str]) -> str:
    # EBNF string literals take JSON's escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


# xgrammar (0.2) writes a string with minLength or maxLength (and a property name with one) as a
# count of one character class, printed as below, that leaves out `"`, `\`, CR and LF but lets the
# other control characters through raw; JSON forbids them in a string (json.loads: "Invalid control
# character"), and a model at temperature 1 does draw tab tokens there. Its other strings allow
# none of them; these are given the same class. (That class takes no escapes, as xgrammar's did not.)
_LENGTH_BOUNDED_CHARACTER = r"[^\"\\\r\n]"
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\]"


def _json_schema_grammar(schema: str, any_whitespace: bool) -> xgrammar.Grammar:
    """xgrammar's grammar of a JSON schema, with no raw control character inside a string."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(
        schema,
        any_whitespace=any_whitespace,
        max_whitespace_cnt=MAX_JSON_WHITESPACE if any_whitespace else None,
    )
    ebnf = str(grammar)
    if _LENGTH_BOUNDED_CHARACTER not in ebnf:
        return grammar
    return xgrammar.Grammar.from_ebnf(ebnf.replace(_LENGTH_BOUNDED_CHARACTER, _JSON_STRING_CHARACTER))


def _what(kind: str) -> str:
    return {"json": "JSON schema", "json_object": "JSON schema"}.get(kind, kind)


class GrammarCompiler:
    """Compiles StructuredOutputsParams into xgrammar grammars for this model's vocabulary (no
    cache here: StructuredOutputs keeps the compiled grammars)."""

    def __init__(self, load_vocabulary: Callable[[], list[bytes]], model_vocab_size: int, eos_token_ids: Sequence[int]):
        self._load_vocabulary = load_vocabulary
        self.model_vocab_size = model_vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """xgrammar's compiler for this vocabulary (the vocabulary read once, on first use)."""
        self._xgr_compiler()

    def _xgr_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
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
                # One thread per compile: it runs on the calling thread, whose CPU clock then counts
                # all of it (engine/grammar_compile.py); compiles run side by side instead.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec`. ValueError names what is wrong with it."""
        compiler = self._xgr_compiler()
        kind, text, any_whitespace = spec.key
        try:
            if kind in ("json", "json_object"):
                schema = '{"type": "object"}' if kind == "json_object" else text
                json.loads(schema)  # a clear message for text that is not JSON at all
                return compiler.compile_grammar(_json_schema_grammar(schema, any_whitespace))
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                return compiler.compile_grammar(_ebnf_choice(json.loads(text)))
            return compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses with its parser's message
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"structured_outputs: the {_what(kind)} could not be compiled: {message}") from None

    def matcher(self, spec: StructuredOutputsParams, output_token_ids: Sequence[int] = ()) -> GrammarState:
        """A fresh matcher for `spec` (compiled now, not cached) that has accepted `output_token_ids`."""
        return GrammarState.start(self.compile(spec), output_token_ids)


class GrammarState:
    """One request's matcher and how many of its output tokens it has taken."""

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self.matcher = matcher
        self.num_accepted = 0

    @classmethod
    def start(cls, grammar: xgrammar.CompiledGrammar, output_token_ids: Sequence[int] = ()) -> GrammarState:
        """A matcher of `grammar` (NOTE: it holds the grammar: evicting it from the cache frees
        nothing while the matcher lives) that has accepted `output_token_ids`."""
        import xgrammar

        state = cls(xgrammar.GrammarMatcher(grammar))
        for token in output_token_ids:
            state.accept(token)
        return state

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

    def buffer(self, rows: int) -> torch.Tensor:
        """The buffer's first `rows` rows (grown where short)."""
        import xgrammar

        if self._buffer is None or self._buffer.shape[0] < rows:
            self._buffer = xgrammar.allocate_token_bitmask(max(rows, 8), self.vocab_size)
        return self._buffer[:rows]

    def fill(self, states: Sequence[GrammarState | None]) -> tuple[torch.Tensor, list[int]]:
        """Row i: the tokens states[i] allows next; a row without a grammar (None) or whose grammar
        ended is left out. Returns the bitmask [len(states), words] (a view of the buffer) and the
        rows to apply it to."""
        self.buffer(len(states))
        assert self._buffer is not None
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
    """The engine core's requests with structured outputs: those waiting for their grammar, the
    matchers of those queued (request id -> its matcher), the compiled grammars, and each step's
    bitmask."""

    def __init__(self, compiler: GrammarCompiler, cache_bytes: int, max_compile_seconds: float) -> None:
        self.compiler = compiler
        self.max_compile_seconds = max_compile_seconds
        self.cache: GrammarCache[xgrammar.CompiledGrammar] = GrammarCache(cache_bytes)
        self.threads = CompileThreads(compiler, COMPILE_THREADS)
        self.matchers: dict[str, GrammarState] = {}
        self.bitmask = TokenBitmask(compiler.model_vocab_size)
        # Requests whose grammar is compiling (or waits to), by id, and the compiles: queued
        # (waiting for a thread, and for the cache to have room), running (abandoned ones too,
        # until they end), and by spec, so that requests asking for the same one share it.
        self.waiting: dict[str, Request] = {}
        self._queued: deque[CompileJob] = deque()
        self._running: list[CompileJob] = []
        self._jobs: dict[GrammarKey, CompileJob] = {}
        self._ready: list[Request] = []
        self._refused: dict[str, str] = {}
        self._timed_out: OrderedDict[int, str] = OrderedDict()  # hash of a spec's key -> why it was refused
        self.num_timed_out = 0

    def add(self, request: Request) -> bool:
        """A new request with a grammar. True: its grammar was compiled (cached), its matcher is
        here and it may be scheduled now; False: it waits here while its grammar compiles
        (take_ready()), or is refused at once (take_refused(): its spec passed the time limit lately)."""
        spec = request.params.structured_outputs
        assert spec is not None
        grammar = self.cache.acquire(spec.key, request.request_id)
        if grammar is not None:
            self.matchers[request.request_id] = GrammarState.start(grammar)
            return True
        timed_out = self._timed_out.get(hash(spec.key))
        if timed_out is not None:
            self._refused[request.request_id] = timed_out
            return False
        self.waiting[request.request_id] = request
        job = self._jobs.get(spec.key)
        if job is None:
            job = self._jobs[spec.key] = CompileJob(spec.key, spec)
            self._queued.append(job)
        job.request_ids.append(request.request_id)
        self._start_compiles()
        return False

    def take_ready(self) -> list[Request]:
        """The requests whose grammar compiled since the last call (their matchers are here)."""
        self._poll()
        ready, self._ready = self._ready, []
        return ready

    def take_refused(self) -> dict[str, str]:
        """Request id -> why, for each request refused since the last call for its grammar (gone from here)."""
        refused, self._refused = self._refused, {}
        return refused

    def wait(self, timeout: float) -> None:
        """Until a compile ends, or `timeout` seconds (when nothing else can run)."""
        if self.waiting:
            self.threads.wait(timeout)

    def shutdown(self) -> None:
        self.threads.shutdown()

    def _poll(self) -> None:
        for job in list(self._running):
            if job.finished.is_set():
                self._running.remove(job)
                if not job.abandoned:
                    self._finish(job)
            elif not job.abandoned and job.cpu_used() > self.max_compile_seconds:
                self._abandon(job)
        self._start_compiles()

    def _start_compiles(self) -> None:
        while self._queued and len(self._running) < self.threads.num_threads and self.cache.has_room():
            job = self._queued.popleft()
            if not any(r in self.waiting for r in job.request_ids):  # every request left meanwhile
                del self._jobs[job.key]
                continue
            self._running.append(job)
            self.threads.submit(job)

    def _abandon(self, job: CompileJob) -> None:
        """Past the time limit: its requests are refused now; the compile cannot be stopped, so
        it runs on in its thread and its result is dropped when it ends."""
        job.abandoned = True
        del self._jobs[job.key]
        self.num_timed_out += 1
        kind, text, _ = job.key
        logger.warning(
            "compiling a %d-byte %s passed %g s of CPU (--max-grammar-compile-seconds): its requests are "
            "refused; the compile runs on in its thread and its result will be dropped",
            len(text.encode()),
            _what(kind),
            self.max_compile_seconds,
        )
        self._refuse_timed_out(
            job,
            f"structured_outputs: compiling the {_what(kind)} took more than {self.max_compile_seconds:g} s of "
            "CPU time, the server's limit (max_grammar_compile_seconds, --max-grammar-compile-seconds)",
        )

    def _finish(self, job: CompileJob) -> None:
        del self._jobs[job.key]
        grammar, job.grammar = job.grammar, None
        what = _what(job.key[0])
        if job.error is not None:
            self._refuse(job, job.error)
        elif (job.cpu_seconds or 0.0) > self.max_compile_seconds:
            self.num_timed_out += 1
            self._refuse_timed_out(
                job,
                f"structured_outputs: compiling the {what} took {job.cpu_seconds:.1f} s of CPU time, more than the "
                f"server's limit of {self.max_compile_seconds:g} s (max_grammar_compile_seconds, "
                "--max-grammar-compile-seconds)",
            )
        elif grammar.memory_size_bytes > self.cache.capacity_bytes:
            self._refuse(
                job,
                f"structured_outputs: the compiled {what} needs {grammar.memory_size_bytes / MiB:.0f} MiB, more "
                f"than the whole grammar cache of {self.cache.capacity_bytes / MiB:.0f} MiB (grammar_cache_bytes, "
                "--grammar-cache-gib)",
            )
        else:
            waiting = [r for r in dict.fromkeys(job.request_ids) if r in self.waiting]
            self.cache.insert(job.key, grammar, grammar.memory_size_bytes, waiting)
            for request_id in waiting:
                self.matchers[request_id] = GrammarState.start(grammar)
                self._ready.append(self.waiting.pop(request_id))

    def _refuse_timed_out(self, job: CompileJob, why: str) -> None:
        self._timed_out[hash(job.key)] = why
        if len(self._timed_out) > REMEMBER_TIMED_OUT:
            self._timed_out.popitem(last=False)
        self._refuse(job, why)

    def _refuse(self, job: CompileJob, why: str) -> None:
        for request_id in dict.fromkeys(job.request_ids):
            if self.waiting.pop(request_id, None) is not None:
                self._refused[request_id] = why

    def fill(
        self, sampled: list[str], drafts: Mapping[str, Sequence[int]] | None = None
    ) -> tuple[list[str], torch.Tensor | None]:
        """The requests among `sampled` (request ids) whose grammar goes on, one per row, and their
        masks [rows, words] int32 (a copy: it travels with the step); ([], None) for none. A
        request verifying drafts has 1 + len(drafts) rows, each the mask after the drafts before
        it (a row after the grammar ended allows every token)."""
        live = [r for r in sampled if r in self.matchers and not self.matchers[r].terminated]
        if not live:
            return [], None
        drafts = drafts or {}
        if not any(drafts.get(r) for r in live):
            bitmask, rows = self.bitmask.fill([self.matchers[r] for r in live])
            assert rows == list(range(len(live)))
            return live, bitmask.clone()
        ids = [r for r in live for _ in range(len(drafts.get(r, ())) + 1)]
        bitmask = self.bitmask.buffer(len(ids))
        row = 0
        for request_id in live:
            matcher = self.matchers[request_id].matcher
            mine = drafts.get(request_id, ())
            taken = 0
            for j in range(len(mine) + 1):
                if matcher.is_terminated():
                    bitmask[row].fill_(-1)
                else:
                    matcher.fill_next_token_bitmask(bitmask, row)
                    if j < len(mine):
                        ok = matcher.accept_token(mine[j])
                        assert ok, "drafts are checked against the grammar when proposed"
                        taken += 1
                row += 1
            if taken:
                matcher.rollback(taken)
        return ids, bitmask.clone()

    def allowed_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        """The drafts the request's grammar allows, up to the first it does not (all of them
        for a request without a grammar, or whose grammar ended)."""
        state = self.matchers.get(request_id)
        if state is None or state.terminated or not drafts:
            return drafts
        matcher, taken = state.matcher, 0
        for token in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            taken += 1
        if taken:
            matcher.rollback(taken)
        return drafts[:taken]

    def accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Tokens a step that succeeded sampled for the request (nothing for one without a grammar)."""
        state = self.matchers.get(request_id)
        if state is not None:
            for token in token_ids:
                state.accept(token)

    def remove(self, request_ids: Sequence[str]) -> None:
        """Requests that are gone (finished, aborted, failed): their matchers, their pins on their
        grammars, and any still waiting for one."""
        for request_id in request_ids:
            self.matchers.pop(request_id, None)
            self.waiting.pop(request_id, None)
            self._refused.pop(request_id, None)
        self.cache.release(request_ids)
        self._start_compiles()
