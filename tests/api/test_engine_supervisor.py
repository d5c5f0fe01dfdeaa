"""EngineSupervisor's judgement of a silent engine, on a clock the test moves: unresponsive past
the heartbeat timeout (and itself again when heard from), killed past the stall timeout, never
while it is still loading; a heartbeat from another process counts for nothing. The process
watched is `cat`: what is judged is the supervisor, not an engine, and a process that echoes a
line after the supervisor's call was not killed by it (a SIGKILL sent lets it run no further)."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from vlmserve.api import engine_supervisor
from vlmserve.api.engine_supervisor import EngineSupervisor
from vlmserve.engine.config import EngineConfig


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(engine_supervisor, "time", clock)
    return clock


@pytest.fixture
def supervisor(tiny_dir: Path) -> Iterator[EngineSupervisor]:
    config = EngineConfig(model=str(tiny_dir), dtype="float32")
    supervisor = EngineSupervisor(
        config,
        "ipc:///nonexistent/in",
        "ipc:///nonexistent/out",
        eos_token_ids=[],
        heartbeat_timeout_s=2,
        stall_timeout_s=5,
    )
    # In place of spawn(): a process that runs until killed.
    supervisor._process = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    yield supervisor
    supervisor._process.kill()
    supervisor._process.communicate()


def answers(supervisor: EngineSupervisor) -> bool:
    """Whether the watched process echoes a line (it was not killed)."""
    process = supervisor._process
    assert process is not None and process.stdin is not None and process.stdout is not None
    try:
        process.stdin.write(b"ping\n")
        process.stdin.flush()
    except BrokenPipeError:
        return False
    return process.stdout.readline() == b"ping\n"


def test_silence_past_the_heartbeat_timeout_is_unavailable_until_a_heartbeat_from_that_process(
    supervisor: EngineSupervisor, clock: Clock
) -> None:
    supervisor.mark_ready("plan")
    clock.now += 1.9
    assert supervisor.unavailable_reason is None
    clock.now += 0.6
    assert supervisor.unavailable_reason == "the engine process has not responded for 2 s"
    assert supervisor.pid is not None
    supervisor.heartbeat(supervisor.pid + 1)  # a killed engine's, read late
    assert supervisor.unavailable_reason == "the engine process has not responded for 2 s"
    supervisor.heartbeat(supervisor.pid)
    assert supervisor.unavailable_reason is None
    clock.now += 4.9  # silent again, not yet for the stall timeout
    supervisor.kill_if_stalled()
    assert answers(supervisor)
    assert supervisor.unavailable_reason == "the engine process has not responded for 5 s"


def test_silence_past_the_stall_timeout_kills_the_engine_and_its_death_says_so(
    supervisor: EngineSupervisor, clock: Clock
) -> None:
    supervisor.mark_ready("plan")
    clock.now += 6.2
    assert answers(supervisor)
    supervisor.kill_if_stalled()
    assert supervisor._process is not None
    assert supervisor._process.wait(30) == -signal.SIGKILL
    assert supervisor.exited
    assert supervisor.died() == "stopped responding (no heartbeat for 5 s) and was killed"
    assert supervisor.unavailable_reason == "the engine is not running"


def test_an_engine_still_loading_is_not_judged_by_heartbeats(supervisor: EngineSupervisor, clock: Clock) -> None:
    clock.now += 3600  # no Ready yet: loading a large checkpoint sends nothing
    supervisor.kill_if_stalled()
    assert answers(supervisor)
    assert supervisor.unavailable_reason == "the engine is not running"
