"""Grammars compile off the engine's step loop, on threads of the engine core's own.

Threads, not a process: a compiled grammar is a large native object (7 MB and up, engine/
grammar_cache.py) that the step loop's matchers use in place; from a process it would have to be
serialized and rebuilt (xgrammar's JSON form: 0.35 s for the smallest Qwen grammar, against its
0.03 s compile, and many GB for a large one). The cost is that a compile cannot be interrupted: one
past its limit is abandoned (its requests are refused, its result dropped when it ends) but runs
on to its end, holding its thread.

So that no compile slows the steps, each thread lowers its own CPU priority (Linux: nice 10 for
that thread alone): the step loop's threads take the cores first and compiles use what is left.
The limit is on the CPU time the compile takes (the thread's own clock), not the wall clock: on a
busy machine a compile waits for CPU, and that is not the grammar's fault. xgrammar runs a compile
on the calling thread when it has one thread (GrammarCompiler's max_threads), so the thread's
clock counts all of it."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from vlmserve.engine.grammar_cache import GrammarKey
from vlmserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

COMPILE_NICE = 10  # added to a compile thread's niceness: about a tenth of a core's share beside the steps


@dataclass(eq=False)
class CompileJob:
    """One distinct spec being compiled, for the requests that wait for it."""

    key: GrammarKey
    spec: StructuredOutputsParams
    request_ids: list[str] = field(default_factory=list)
    abandoned: bool = False  # past the time limit: its requests were refused, its result is dropped
    # Written by the thread that compiles it; `finished` is set last.
    started: bool = False
    cpu_start: float = 0.0  # its thread's CPU time when the compile started
    clock: int | None = None  # that thread's CPU-time clock (None where there is none: the wall clock)
    cpu_seconds: float | None = None  # what the compile took, once finished
    grammar: Any = None
    error: str | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    def cpu_used(self) -> float:
        """CPU seconds the compile has taken so far."""
        if self.cpu_seconds is not None or not self.started:
            return self.cpu_seconds or 0.0
        try:
            now = time.monotonic() if self.clock is None else time.clock_gettime(self.clock)
        except OSError:
            return 0.0
        return max(0.0, now - self.cpu_start)


class Compiler(Protocol):
    def prepare(self) -> None:
        """What every compile needs first (the vocabulary, read once): not counted in its time."""

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar. ValueError: the spec's fault, with why."""


class CompileThreads:
    """`num_threads` daemon threads that compile the jobs they are given, one at a time each."""

    def __init__(self, compiler: Compiler, num_threads: int) -> None:
        self.compiler = compiler
        self.num_threads = num_threads
        self._jobs: queue.SimpleQueue[CompileJob | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._woken = threading.Event()  # a job finished since the last wait()

    def submit(self, job: CompileJob) -> None:
        if not self._threads:  # started with the first grammar, as the vocabulary is read
            for i in range(self.num_threads):
                thread = threading.Thread(target=self._run, name=f"grammar-compile-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)
        self._jobs.put(job)

    def wait(self, timeout: float) -> None:
        """Until a job finishes, or `timeout` seconds."""
        self._woken.wait(timeout)
        self._woken.clear()

    def shutdown(self) -> None:
        """The threads end after the job each is running (a compile cannot be interrupted)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _run(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # not Linux: the compiles share the CPU evenly
            native_id = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, native_id, os.getpriority(os.PRIO_PROCESS, native_id) + COMPILE_NICE)
        clock: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            clock = time.pthread_getcpuclockid(threading.get_ident())
        now = time.monotonic if clock is None else time.thread_time
        while (job := self._jobs.get()) is not None:
            try:
                self.compiler.prepare()
                job.clock, job.cpu_start = clock, now()
                job.started = True
                job.grammar = self.compiler.compile(job.spec)
            except ValueError as e:  # the spec's fault: GrammarCompiler.compile names it
                job.error = str(e)
            except Exception as e:  # our own: the request fails alone, the thread goes on
                logger.exception("compiling a %s grammar raised", job.key[0])
                job.error = f"structured_outputs: compiling the grammar raised {type(e).__name__}"
            job.cpu_seconds = now() - job.cpu_start if job.started else 0.0
            if job.abandoned:
                logger.info(
                    "an abandoned %s grammar compile ended after %.1f s of CPU; its result is dropped",
                    job.key[0],
                    job.cpu_seconds,
                )
                job.grammar = None
            job.finished.set()
            self._woken.set()
