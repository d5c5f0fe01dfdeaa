"""Issue 13, item 4: a stalled engine is visible. The engine process is stopped (SIGSTOP) under a
real `vlmserve serve` with short thresholds: silent for --engine-heartbeat-timeout (5 s), /health
and new requests get 503 naming the silence while requests in flight wait; resumed (SIGCONT), the
same process finishes them with the tokens they would have had alone. Silent for
--engine-stall-timeout (15 s), it is killed and restarted: its requests get 503 naming the stall,
and no shared-memory segment is left, not even one the engine never took.

Every wait is for a state (the engine process's own state in /proc, /health, /metrics, an answer),
under a generous deadline. The one window a test must act in: the image request of the second test
must reach the engine within the heartbeat timeout of the stop (it is sent at once, and takes a
fraction of a second); the test fails naming it if it does not."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import Server, data_url, image_message, picture, segments_left, start_server
from tests.api.test_faults import RawRequest, StreamReader, alive, metric, wait_for_state, wait_idle, wait_until

HEARTBEAT_TIMEOUT = 5
STALL_TIMEOUT = 15
CHAT = "/v1/chat/completions"
GREEDY = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def stall_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tiny_dir,
        tmp_path_factory.mktemp("stall"),
        "--engine-heartbeat-timeout",
        str(HEARTBEAT_TIMEOUT),
        "--engine-stall-timeout",
        str(STALL_TIMEOUT),
    )
    yield server
    server.stop()


def health(server: Server) -> tuple[int, str]:
    """/health's status code and the reason it gives for a 503."""
    response = httpx.get(server.url + "/health", timeout=10)
    return response.status_code, response.json().get("reason", "")


def stopped(pid: int) -> bool:
    return "\nState:\tT" in Path(f"/proc/{pid}/status").read_text()


def streamed_text(reader: StreamReader) -> str:
    return "".join(c["delta"].get("content") or "" for e in reader.events for c in e.get("choices", []))


def wait_for_silence_noticed(server: Server) -> str:
    state: list[tuple[int, str]] = [(0, "")]

    def noticed() -> bool:
        state[0] = health(server)
        return state[0][0] == 503 and "has not responded" in state[0][1]

    wait_until(noticed, lambda: f"/health never reported the silent engine; last: {state[0]}", timeout=60)
    return state[0][1]


def test_a_stopped_engine_makes_health_503_and_resumes_its_requests_with_their_own_tokens(
    stall_server: Server,
) -> None:
    server = stall_server
    server.wait_healthy()
    wait_idle(server)
    engine = server.engine_pid()
    prompt = [{"role": "user", "content": "Count slowly."}]
    alone = server.post(CHAT, {"messages": prompt, **GREEDY})
    assert alone.status_code == 200, alone.text
    # A client that will leave during the stall, its request running in the engine meanwhile.
    leaving = RawRequest(server, {"messages": [{"role": "user", "content": "go"}], **GREEDY, "max_tokens": 4000})
    kept = StreamReader(
        server,
        {"messages": prompt, **GREEDY, "logprobs": True, "stream_options": {"include_usage": True}},
        on_first_token=lambda: os.kill(engine, signal.SIGSTOP),
    )
    try:
        wait_for_state(server, "the leaving request running", lambda s: s["running"] == 1)
        kept.start()
        wait_until(lambda: stopped(engine), lambda: f"the engine was never stopped: {kept.error!r}", timeout=60)
        assert not kept.done and 0 < kept.tokens() < GREEDY["max_tokens"]  # stopped mid-request
        reason = wait_for_silence_noticed(server)
        assert reason.startswith("the engine process has not responded for ")
        refused = server.post(CHAT, {"messages": prompt, "max_tokens": 2})
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "engine_unavailable" and "has not responded" in error["message"]
        leaving.leave()  # its abort waits on the socket for the engine to come back
        wait_until(
            lambda: metric(server, "vlmserve_requests_in_flight") == 1, lambda: "the API still serves the leaver"
        )
        assert kept.is_alive() and kept.error is None and not any("error" in e for e in kept.events)
        os.kill(engine, signal.SIGCONT)
        server.wait_healthy(60)
        kept.join(120)
        assert not kept.is_alive() and kept.error is None and kept.done, kept.events[-1:]
        assert streamed_text(kept) == alone.json()["choices"][0]["message"]["content"]
        assert kept.events[-1]["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    finally:
        if alive(engine):
            os.kill(engine, signal.SIGCONT)
        leaving.leave()
    # The leaver's 4000 tokens were dropped by the same engine, which now serves new requests.
    wait_idle(server)
    assert server.engine_pid() == engine
    again = server.post(CHAT, {"messages": prompt, "max_tokens": 3})
    assert again.status_code == 200, again.text
    assert health(server) == (200, "")
    assert metric(server, "vlmserve_engine_restarts") == 0
    assert segments_left() == []


@pytest.mark.slow
def test_an_engine_stopped_past_the_stall_timeout_is_killed_its_requests_fail_naming_it_and_it_restarts(
    stall_server: Server,
) -> None:
    server = stall_server
    server.wait_healthy()
    wait_idle(server)
    engine = server.engine_pid()
    restarts = metric(server, "vlmserve_engine_restarts")
    running = StreamReader(
        server,
        {"messages": [{"role": "user", "content": "x"}], **GREEDY, "max_tokens": 3000, "logprobs": True},
        on_first_token=lambda: os.kill(engine, signal.SIGSTOP),
    )
    pending: list[httpx.Response] = []
    image_body = {"messages": image_message(data_url(picture(7))), "max_tokens": 4}
    poster = threading.Thread(target=lambda: pending.append(server.post(CHAT, image_body)), daemon=True)
    try:
        running.start()
        wait_until(lambda: stopped(engine), lambda: f"the engine was never stopped: {running.error!r}", timeout=60)
        poster.start()  # its pixels wait in shared memory for an engine that does not read them
        wait_until(
            lambda: bool(segments_left()) or bool(pending),
            lambda: "the image request never wrote its pixels",
            timeout=60,
        )
        assert not pending, f"the image request did not reach the engine before its silence was noticed: {pending}"
        wait_for_silence_noticed(server)
        running.join(120)
        poster.join(120)
        assert not running.is_alive() and not poster.is_alive()
    finally:
        if alive(engine):
            os.kill(engine, signal.SIGCONT)
    stall = (
        f"the engine process stopped responding (no heartbeat for {STALL_TIMEOUT} s) and was killed "
        "while serving this request"
    )
    assert running.done and running.events[-1]["error"]["type"] == "service_unavailable"
    assert running.events[-1]["error"]["message"] == stall
    assert pending[0].status_code == 503, pending[0].text
    assert pending[0].json()["error"] == {
        "message": stall,
        "type": "service_unavailable",
        "param": None,
        "code": "engine_unavailable",
    }
    assert not alive(engine)
    assert segments_left() == []  # the image's pixels too, which the engine never took
    server.wait_healthy(120)  # restarted
    assert server.engine_pid() != engine
    ok = server.post(CHAT, {"messages": image_message(data_url(picture(8))), "max_tokens": 3})
    assert ok.status_code == 200, ok.text
    assert metric(server, "vlmserve_engine_restarts") == restarts + 1
    wait_idle(server)
    assert segments_left() == []
    assert json.loads(httpx.get(server.url + "/health", timeout=10).text) == {"status": "ok"}
