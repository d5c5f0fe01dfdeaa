"""The engine process as a process: started on the API process's socket addresses with the
engine config, known ready when its Ready message arrives, watched for death and for silence,
started again after a death up to `max_restarts` times, and stopped at shutdown (killed if it does
not exit in time). What travels on the sockets, and the requests in flight, are the client's
business.

Silence: the engine sends a heartbeat every 0.5 s from a thread of its own. Once ready, an engine
not heard from for `heartbeat_timeout_s` is unresponsive (the server answers 503 until it is heard
from again: same process, nothing lost); one silent for `stall_timeout_s` is killed (SIGKILL: a
stopped process does not act on SIGTERM), and its death is handled as any other: a restart that
counts toward `max_restarts`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time

import msgspec

from vlmserve.engine.config import EngineConfig
from vlmserve.lora.request import LoRARequest

logger = logging.getLogger("vlmserve.api")


class EngineDeadError(RuntimeError):
    """The engine process is not running (it died, or is still starting) or not responding."""


def _engine_config_json(config: EngineConfig) -> str:
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "media_limits"}
    return json.dumps(fields)


class EngineSupervisor:
    def __init__(
        self,
        config: EngineConfig,
        input_address: str,
        output_address: str,
        *,
        eos_token_ids: list[int],
        threads: int = 0,
        max_restarts: int = 3,
        heartbeat_timeout_s: float = 10.0,
        stall_timeout_s: float = 60.0,
        index: int | None = None,
    ) -> None:
        """`index`: the engine's, among data-parallel engines (None: the only one), in its logs."""
        self.config = config
        self.index = index
        self.name = "the engine" if index is None else f"engine {index}"
        # The engine loads no tokenizer: the ids that end generation come from here.
        self.eos_token_ids = eos_token_ids
        self.input_address = input_address  # the engine pulls requests here
        self.output_address = output_address  # and pushes its outputs here
        self.threads = threads
        # The adapters an engine loads when it starts (a restarted one too): the server's, by name.
        self.loras: dict[str, LoRARequest] = {}
        self.max_restarts = max_restarts
        self.restarts = 0
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.ready = asyncio.Event()
        self.memory_plan = ""
        self.summary: dict[str, str] = {}  # the start-up banner's lines, from its Ready message
        self.was_ready = False  # once: an engine that dies before it was ever ready is not restarted
        self._process: subprocess.Popen[bytes] | None = None
        self._spawned_at = 0.0
        self._last_heartbeat = 0.0  # time.monotonic() of the running engine's latest
        self._killed_for = ""  # why we killed the running engine, if we did

    def spawn(self) -> None:
        command = [
            sys.executable,
            "-m",
            "vlmserve.engine.engine_process",
            "--config",
            _engine_config_json(self.config),
            "--input",
            self.input_address,
            "--output",
            self.output_address,
            "--parent",
            str(os.getpid()),
            "--threads",
            str(self.threads),
            "--eos-token-ids",
            json.dumps(self.eos_token_ids),
            *(["--engine-index", str(self.index)] if self.index is not None else []),
            *(["--lora-modules", msgspec.json.encode(list(self.loras.values())).decode()] if self.loras else []),
            *(["--restarted"] if self.was_ready else []),
        ]
        self.ready.clear()
        self._spawned_at = time.monotonic()
        self._killed_for = ""
        # NOTE: a POSIX session of its own (setsid): a terminal's Ctrl-C goes to the API process's group, not to
        # the engine (nor its tensor-parallel ranks); the API process drains and then stops it, as
        # on SIGTERM. The engine exits by itself when the API process is gone (its --parent watch).
        self._process = subprocess.Popen(command, start_new_session=True)

    async def wait_ready(self, timeout_s: float) -> None:
        """Until the Ready message; EngineDeadError at once if the process exits first (its
        error is in the log above: the checkpoint, the memory budget...)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # NOTE: asyncio.wait, not wait_for: on Python 3.11 wait_for returns the result of an inner
        # wait that completes as the task is cancelled, losing the cancellation, so a Ctrl-C that
        # lands as the engine becomes ready was lost (the server started and ignored it).
        ready = asyncio.ensure_future(self.ready.wait())
        try:
            while not self.ready.is_set():
                if self.exited:
                    code = self._process.returncode if self._process else None
                    raise EngineDeadError(
                        f"the engine process exited (code {code}) before it was ready; its error is above"
                    )
                if loop.time() > deadline:
                    raise EngineDeadError(f"the engine process did not become ready within {timeout_s:.0f}s")
                await asyncio.wait({ready}, timeout=0.2)
        finally:
            ready.cancel()

    def mark_ready(self, memory_plan: str, summary: dict[str, str] | None = None) -> None:
        """The engine said it is ready (its Ready message). What it was built with is the
        server's start-up banner; a restarted engine is only noted."""
        self.memory_plan = memory_plan
        self.summary = dict(summary or {})
        self.was_ready = True
        self._last_heartbeat = time.monotonic()
        self.ready.set()
        logger.info(
            "%s process ready (pid %s, %.1f s after it was started)",
            "engine" if self.index is None else f"engine {self.index}",
            self.pid,
            self.elapsed,
        )

    @property
    def elapsed(self) -> float:
        """Seconds since the engine process was last started."""
        return time.monotonic() - self._spawned_at

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def healthy(self) -> bool:
        return self.ready.is_set() and self.running

    def heartbeat(self, pid: int) -> None:
        """A Heartbeat message arrived (one from an engine since killed is ignored)."""
        if pid == self.pid:
            self._last_heartbeat = time.monotonic()

    @property
    def silent_s(self) -> float:
        """Seconds since the running engine's latest heartbeat (or its Ready message)."""
        return time.monotonic() - self._last_heartbeat

    @property
    def unavailable_reason(self) -> str | None:
        """Why the engine cannot serve a request now; None when it can."""
        if not self.healthy:
            return "the engine is not running"
        silent = self.silent_s
        if silent > self.heartbeat_timeout_s:
            return f"the engine process has not responded for {silent:.0f} s"
        return None

    def kill_if_stalled(self) -> None:
        """Kill a ready engine silent for more than `stall_timeout_s`; `exited` then sees it. Call
        it only with nothing unread on the engine's socket (a heartbeat may be waiting there)."""
        if self._process is None or not self.healthy or self._killed_for or self.silent_s <= self.stall_timeout_s:
            return
        self._killed_for = f"stopped responding (no heartbeat for {self.stall_timeout_s:g} s) and was killed"
        logger.error("%s process (pid %s) %s", self.name, self.pid, self._killed_for)
        self._process.kill()

    @property
    def exited(self) -> bool:
        """The engine process was started and has exited since (not yet restarted)."""
        return self._process is not None and self._process.poll() is not None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def died(self) -> str:
        """Note an exit seen by `exited`: logged, and not ready until a restart is. Says what
        happened to it, e.g. "died (exit code -9)"."""
        code = self._process.returncode if self._process else None
        if self.was_ready:
            logger.error("%s process exited (code %s)", self.name, code)
        # else it never started: wait_ready() reports that, once, to whoever waits to serve
        self.ready.clear()
        return self._killed_for or f"died (exit code {code})"

    def restart(self) -> bool:
        """Start the engine again after a death; False (and no process from now on) once it has
        died more than `max_restarts` times."""
        if self.restarts >= self.max_restarts:
            self._process = None
            logger.error("%s died %d times; not restarting it", self.name, self.restarts + 1)
            return False
        self.restarts += 1
        logger.warning("restarting %s (restart %d of %d)", self.name, self.restarts, self.max_restarts)
        self.spawn()
        return True

    async def join(self, timeout_s: float) -> None:
        """Wait for the engine process to exit (it was asked to); killed after `timeout_s`."""
        if self._process is None:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self._process.wait), timeout_s)
        except TimeoutError:
            self._process.kill()
