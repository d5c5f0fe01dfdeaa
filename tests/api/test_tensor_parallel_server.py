"""The server with --tensor-parallel-size 2: a rank killed mid-stream fails the request in flight
(never a hang), the engine process exits and is started again with new ranks, and the next
request is answered; no rank of the dead engine is left.

Both tests run on one server (a start of the API process, the engine and its two ranks costs
more than either test's own work): each starts from the engine it finds, kills or stops one of
its ranks and waits for the engine after it; two restarts are within --max-engine-restarts' 3."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.conftest import Server, start_server
from tests.api.test_faults import LONG, StreamReader, alive, wait_until


@pytest.fixture(scope="module")
def tp_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """--engine-stall-timeout and --engine-heartbeat-timeout for the stopped rank; a killed rank
    ends its engine whatever they are."""
    server = start_server(
        tiny_dir,
        tmp_path_factory.mktemp("tp-server"),
        "--tensor-parallel-size",
        "2",
        "--engine-stall-timeout",
        "8",
        "--engine-heartbeat-timeout",
        "4",
        "--log-level",
        "info",
    )
    yield server
    server.stop()


def rank_pids(engine_pid: int) -> list[int]:
    """The engine process's rank processes (multiprocessing's spawn children)."""
    children = Path(f"/proc/{engine_pid}/task/{engine_pid}/children").read_text().split()
    return [int(pid) for pid in children if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]


@pytest.mark.slow
def test_a_killed_rank_fails_the_stream_and_the_restarted_engine_answers(tp_server: Server) -> None:
    server = tp_server
    engine = server.engine_pid()
    ranks = rank_pids(engine)
    assert len(ranks) == 2, ranks
    reader = StreamReader(server, {"messages": [{"role": "user", "content": "x"}], **LONG, "logprobs": True})
    reader.start()
    wait_until(lambda: reader.tokens() >= 3 or not reader.is_alive(), lambda: f"{reader.tokens()} tokens came")
    assert reader.tokens() >= 3, f"the stream ended early: {reader.error!r} {reader.events[-1:]}"
    os.kill(ranks[1], signal.SIGKILL)
    reader.join(30)
    assert not reader.is_alive(), "the stream hung after a rank died"
    assert reader.events[-1]["error"]["type"] == "service_unavailable", reader.events[-1]
    wait_until(lambda: not any(alive(pid) for pid in [engine, *ranks]), lambda: "the dead engine's ranks live on")
    server.wait_healthy(120)  # restarted, with ranks of its own
    assert len(rank_pids(server.engine_pid())) == 2
    ok = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
    assert ok.status_code == 200, ok.text


@pytest.mark.slow
def test_a_stopped_rank_is_noticed_and_the_ranks_restarted(tp_server: Server) -> None:
    """SIGSTOP on rank 1 mid-stream: rank 0 waits in its collective for ever and the engine's own
    heartbeat goes on, but rank 1's heartbeat stops; after --engine-stall-timeout the stream gets
    an error event naming the rank, the ranks (the stopped one too) are killed, the engine is
    started again and answers."""
    server = tp_server
    logged = len(server.log.read_text())  # the log from here on is this test's
    engine = server.engine_pid()
    ranks = rank_pids(engine)
    reader = StreamReader(server, {"messages": [{"role": "user", "content": "x"}], **LONG, "logprobs": True})
    reader.start()
    wait_until(lambda: reader.tokens() >= 3 or not reader.is_alive(), lambda: f"{reader.tokens()} tokens came")
    assert reader.tokens() >= 3, f"the stream ended early: {reader.error!r} {reader.events[-1:]}"
    os.kill(ranks[1], signal.SIGSTOP)
    reader.join(60)
    assert not reader.is_alive(), "the stream hung behind a stopped rank"
    error = reader.events[-1]["error"]
    assert error["type"] == "service_unavailable", error
    wait_until(lambda: not any(alive(pid) for pid in [engine, *ranks]), lambda: "the stopped rank lives on")
    server.wait_healthy(120)
    assert server.engine_pid() != engine and len(rank_pids(server.engine_pid())) == 2
    ok = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
    assert ok.status_code == 200, ok.text
    log = server.log.read_text()[logged:]
    assert "tensor-parallel rank 1 has not been heard from" in log, log[-3000:]
