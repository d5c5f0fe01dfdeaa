"""Issue 13: idle connections cannot exhaust the API process's descriptors. The server raises its
soft RLIMIT_NOFILE to the hard limit and keeps its client connections under a cap that fits in
it; past the cap, the connection that has waited longest without a request is closed, so a
client that sends its request at once (/health's probe) is answered however many idle sockets
are open. Only when every connection is serving a request does a new one get a 503."""

from __future__ import annotations

import re
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import Server, start_server
from vlmserve.api.connections import connection_limits

HARD_LIMIT = 256
IDLE_SOCKETS = 300  # more than the limit itself
PROMPT = [{"role": "user", "content": "Hello there."}]


@pytest.fixture(scope="module")
def low_limit(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose process may open 256 descriptors (soft and hard): nothing to raise. The
    read timeout is far past the test: only the cap can close an idle socket in time."""
    wrap = ("sh", "-c", f'ulimit -n {HARD_LIMIT} && exec "$@"', "sh")
    s = start_server(tiny_dir, tmp_path_factory.mktemp("fds"), "--read-timeout", "300", wrap=wrap)
    yield s
    s.stop()


def _closed_by_server(sockets: list[socket.socket], at_least: int, timeout: float = 30) -> int:
    """Wait until `at_least` of the sockets read end-of-file; how many did."""
    deadline = time.monotonic() + timeout
    closed: set[int] = set()
    while len(closed) < at_least and time.monotonic() < deadline:
        readable, _, _ = select.select([s for s in sockets if s.fileno() not in closed], [], [], 0.5)
        for s in readable:
            try:
                data = s.recv(1)
            except ConnectionResetError:
                data = b""
            assert data == b"", "the server sent something to a socket that sent nothing"
            closed.add(s.fileno())
    return len(closed)


def test_idle_sockets_past_the_descriptor_limit_leave_health_and_requests_answered(low_limit: Server) -> None:
    log = low_limit.log.read_text()
    found = re.search(rf"at most (\d+) client connections fit under the open-files limit of {HARD_LIMIT}", log)
    assert found, log[-2000:]
    cap = int(found.group(1))
    assert 32 <= cap < HARD_LIMIT
    engine = low_limit.engine_pid()

    port = int(low_limit.url.rsplit(":", 1)[1])
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(IDLE_SOCKETS)]
    try:
        assert low_limit.health() == 200  # a new connection, accepted after every idle one
        reply = low_limit.post("/v1/chat/completions", {"model": "tiny", "messages": PROMPT, "max_tokens": 3})
        assert reply.status_code == 200, reply.text
        # The idle sockets past the cap were closed, oldest first (the probes' own connections
        # took places too); none of them got a byte.
        assert _closed_by_server(sockets, IDLE_SOCKETS - cap) >= IDLE_SOCKETS - cap
        assert sum(s.fileno() != -1 for s in sockets) == IDLE_SOCKETS
        open_now = len(list(Path(f"/proc/{low_limit.process.pid}/fd").iterdir()))
        assert open_now < HARD_LIMIT - 32
    finally:
        for s in sockets:
            s.close()
    assert low_limit.engine_pid() == engine and low_limit.health() == 200
    assert "Too many open files" not in low_limit.log.read_text()


@pytest.fixture(scope="module")
def two_connections(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tiny_dir, tmp_path_factory.mktemp("two"), "--max-connections", "2")
    yield s
    s.stop()


def test_when_every_connection_is_serving_a_request_a_new_one_gets_503_until_one_ends(
    two_connections: Server,
) -> None:
    server = two_connections
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(headers=server.headers, timeout=60) as first, httpx.Client(headers=server.headers) as second:
        streams = [c.stream("POST", server.url + "/v1/chat/completions", json=body) for c in (first, second)]
        responses = [s.__enter__() for s in streams]
        # Kept: a line iterator dropped half-read closes its connection.
        lines = [response.iter_lines() for response in responses]
        try:
            for response, stream_lines in zip(responses, lines, strict=True):
                assert response.status_code == 200
                next(stream_lines)  # being answered: neither connection may be closed for room
            refused = httpx.get(server.url + "/health", timeout=10)
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "too_many_connections"
            assert "limit of 2 connections" in refused.json()["error"]["message"]
        finally:
            streams[0].__exit__(None, None, None)  # one client leaves: its place comes back
        deadline = time.monotonic() + 30
        while server.health() != 200:
            assert time.monotonic() < deadline, "no place came back after a stream ended"
            time.sleep(0.1)
        streams[1].__exit__(None, None, None)


def test_the_cap_leaves_room_for_what_asyncio_accepts_at_once() -> None:
    cap, backlog = connection_limits(1024, 256, 20)
    assert cap + 2 * backlog + 20 + 64 <= 256 and backlog >= 16
    assert connection_limits(1024, 1 << 20, 20) == (1024, 2048)  # a roomy limit: the flag's value
    assert connection_limits(1024, 100, 90)[0] == 1  # no room at all: one connection still
