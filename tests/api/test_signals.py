"""Ctrl-C in a terminal: the terminal sends SIGINT to the server's whole process group. The engine
process (and its ranks) run in a session of their own, so only the API process gets it, and it
does what it does on SIGTERM: requests in flight finish, the engine is stopped, the server exits;
while the engine is still loading, it is stopped and the server exits at once. No traceback, no
engine restart. Each server here runs in a process group of its own, as a terminal starts it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.api.conftest import Server, start_server
from tests.api.test_faults import StreamReader, alive, wait_until


def ctrl_c(server: Server) -> None:
    os.killpg(os.getpgid(server.process.pid), signal.SIGINT)


def exited_cleanly(server: Server, within: float, engine: int | None) -> str:
    """The server's log, once it has exited within `within` seconds of now: no traceback, no
    restarted engine, and the engine process gone."""
    start = time.monotonic()
    code = server.process.wait(within + 30)  # a hang is reported below, with the log
    took = time.monotonic() - start
    log = server.log.read_text()
    assert took <= within, f"exited {took:.1f} s after Ctrl-C (at most {within}):\n{log[-3000:]}"
    assert code in (0, 130, -signal.SIGINT), (code, log[-3000:])
    assert "Traceback" not in log, log[-3000:]
    assert "restarting" not in log, log[-3000:]
    if engine is not None:
        wait_until(lambda: not alive(engine), lambda: "the engine process outlived the server", 10)
    return log


def test_ctrl_c_on_an_idle_server_stops_it_and_its_engine(tiny_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_dir, tmp_path, new_session=True)
    try:
        engine = server.engine_pid()
        assert os.getpgid(engine) != os.getpgid(server.process.pid)  # out of the terminal's group
        ctrl_c(server)
        exited_cleanly(server, 5, engine)
    finally:
        server.stop()


def test_ctrl_c_mid_request_finishes_the_request_then_exits(tiny_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_dir, tmp_path, "--log-level", "info", new_session=True)
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 48,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": True,
    }
    reader = StreamReader(server, body)
    try:
        engine = server.engine_pid()
        reader.start()
        wait_until(lambda: reader.tokens() > 0, lambda: f"no token streamed: {reader.error!r}", 60)
        ctrl_c(server)
        reader.join(60)
        # The engine was not interrupted: the stream goes on to its last token.
        assert reader.error is None and reader.done, (reader.error, server.log.read_text()[-2000:])
        assert reader.tokens() == 48 and reader.finish_reasons() == ["length"]
        log = exited_cleanly(server, 5, engine)
        assert "finishing requests in flight" in log
    finally:
        server.stop()


def test_ctrl_c_while_the_engine_loads_stops_it_at_once(tiny_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_dir, tmp_path, "--log-level", "info", new_session=True, wait=False)
    try:
        # Once the engine process runs (loading its model), before the server is ready.
        def engine_started() -> bool:
            try:
                server.engine_pid()
                return server.health() == 0
            except (RuntimeError, FileNotFoundError):
                return False

        wait_until(engine_started, lambda: server.log.read_text()[-2000:], 60)
        engine = server.engine_pid()
        ctrl_c(server)
        log = exited_cleanly(server, 5, engine)
        assert "interrupted while starting" in log
    finally:
        server.stop()


def test_a_second_ctrl_c_exits_without_waiting_for_the_drain(tiny_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_dir, tmp_path, new_session=True)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3000, "ignore_eos": True, "logprobs": True}
    reader = StreamReader(server, body)
    try:
        engine = server.engine_pid()
        reader.start()
        wait_until(lambda: reader.tokens() > 0, lambda: f"no token streamed: {reader.error!r}", 60)
        ctrl_c(server)
        time.sleep(0.5)
        assert server.process.poll() is None  # draining: the long request goes on
        ctrl_c(server)
        exited_cleanly(server, 5, engine)
        assert reader.tokens() < 3000
    finally:
        server.stop()
