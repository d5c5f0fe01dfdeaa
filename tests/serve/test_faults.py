"""Processes and cancellation (BAD_INPUTS 21-28) against real servers: clients that go away,
an engine that dies, an API process that dies, SIGTERM, overload, a crashed run's segments."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.serve.conftest import Server, data_url, image_message, picture, segments_left, start_server
from tests.serve.upstream import serve
from vlmserve.serve import shm

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def metric(server: Server, name: str) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_idle(server: Server, timeout: float = 3.0) -> float:
    """Seconds until the engine runs nothing and the API serves nothing (the engine reports
    its state every 0.5 s)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if (
            metric(server, "vlmserve_num_requests_running") == 0
            and metric(server, "vlmserve_num_requests_waiting") == 0
            and metric(server, "vlmserve_requests_in_flight") == 0
        ):
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError("requests still running after the clients left")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has exited


@pytest.fixture(scope="module")
def drip() -> Iterator[int]:
    """A media host that answers one byte per second."""
    httpd, _ = serve(drip_interval=1.0)
    yield httpd.server_address[1]
    httpd.shutdown()


@pytest.fixture(scope="module")
def small(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory, drip: int) -> Iterator[Server]:
    """One request at a time, two in flight at most; the drip server may be fetched from."""
    s = start_server(
        tiny_dir,
        tmp_path_factory.mktemp("small"),
        "--max-num-seqs",
        "1",
        "--max-queue",
        "2",
        "--allow-media-network",
        f"127.0.0.1/32:{drip}",
        "--media-fetch-timeout",
        "30",
    )
    yield s
    s.stop()


def stream_then_leave(server: Server, body: dict, chunks: int) -> None:
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, headers=server.headers
        ) as response,
    ):
        assert response.status_code == 200
        for i, _ in enumerate(response.iter_lines()):
            if i >= chunks:
                break  # the client goes away mid-stream


def post_then_leave(server: Server, body: dict, after: float) -> None:
    with httpx.Client(timeout=after) as client, pytest.raises(httpx.ReadTimeout):
        client.post(server.url + "/v1/chat/completions", json=body, headers=server.headers)


def test_client_leaving_mid_stream_aborts_every_sample(small: Server) -> None:
    body = {"messages": image_message(data_url(picture(5))), **LONG, "n": 3}
    stream_then_leave(small, body, chunks=8)
    assert wait_idle(small) < 3
    assert segments_left() == []


def test_client_leaving_a_non_streamed_request(small: Server) -> None:
    post_then_leave(small, {"messages": [{"role": "user", "content": "go"}], **LONG}, after=1.0)
    assert wait_idle(small) < 3


def test_client_leaving_while_queued(small: Server) -> None:
    results: list[int] = []
    running = threading.Thread(
        target=lambda: results.append(
            small.post(
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "a"}], "max_tokens": 150, "ignore_eos": True},
            ).status_code
        )
    )
    running.start()
    time.sleep(0.5)
    post_then_leave(small, {"messages": [{"role": "user", "content": "b"}], **LONG}, after=1.0)  # waits behind it
    running.join()
    assert results == [200]
    assert wait_idle(small) < 3


def test_client_leaving_while_its_media_is_fetched(small: Server, drip: int) -> None:
    body = {"messages": image_message(f"http://127.0.0.1:{drip}/drip"), "max_tokens": 2}
    post_then_leave(small, body, after=1.5)
    assert wait_idle(small) < 3
    assert segments_left() == []


def test_past_the_queue_limit_429_at_once(small: Server) -> None:
    threads = [
        threading.Thread(
            target=lambda: small.post(
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "x"}], "max_tokens": 120, "ignore_eos": True},
            )
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)
    start = time.monotonic()
    response = small.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "y"}], "max_tokens": 2})
    assert response.status_code == 429 and time.monotonic() - start < 1
    assert response.json()["error"]["type"] == "rate_limit_error"
    for t in threads:
        t.join()
    assert small.health() == 200


def test_engine_death_errors_in_flight_then_restarts(tiny_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_dir, tmp_path)
    try:
        events: list[dict] = []

        def stream() -> None:
            with (
                httpx.Client(timeout=60) as client,
                client.stream(
                    "POST",
                    server.url + "/v1/chat/completions",
                    headers=server.headers,
                    json={"messages": [{"role": "user", "content": "x"}], **LONG, "stream": True},
                ) as response,
            ):
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))

        reader = threading.Thread(target=stream)
        reader.start()
        while len(events) < 5:
            time.sleep(0.05)
        engine = server.engine_pid()
        os.kill(engine, signal.SIGKILL)
        reader.join(10)
        assert not reader.is_alive(), "the stream hung after the engine died"
        assert "error" in events[-1] and events[-1]["error"]["type"] == "service_unavailable"
        start = time.monotonic()
        while server.health() == 200 and time.monotonic() - start < 2:
            time.sleep(0.05)
        refused = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert refused.status_code == 503
        server.wait_healthy(60)  # restarted
        assert server.engine_pid() != engine
        ok = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
        assert ok.status_code == 200
        assert metric(server, "vlmserve_engine_restarts") == 1
        assert segments_left() == []
    finally:
        server.stop()


def test_api_process_death_ends_the_engine(tiny_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_dir, tmp_path)
    engine = server.engine_pid()
    server.process.kill()
    server.process.wait()
    deadline = time.monotonic() + 5
    while alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(engine)


def test_sigterm_finishes_in_flight_and_refuses_new(tiny_dir: Path, tmp_path: Path) -> None:
    # A crashed run left a segment behind: the next start sweeps it.
    code = "import numpy as np; from vlmserve.serve import shm; print(shm.write_array(np.ones(8, np.float32)).name)"
    orphan = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert orphan in shm.list_segments()
    server = start_server(tiny_dir, tmp_path)
    assert orphan not in shm.list_segments()
    try:
        result: dict = {}

        def long_request() -> None:
            r = server.post(
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "x"}], "max_tokens": 200, "ignore_eos": True},
            )
            result["status"], result["body"] = r.status_code, r.json()

        engine = server.engine_pid()
        keep_alive = httpx.Client(timeout=10)
        assert keep_alive.get(server.url + "/health").status_code == 200
        worker = threading.Thread(target=long_request)
        worker.start()
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        try:
            late = keep_alive.post(
                server.url + "/v1/chat/completions",
                headers=server.headers,
                json={"messages": [{"role": "user", "content": "late"}]},
            )
            assert late.status_code == 503
        except httpx.TransportError:
            pass  # or the connection is already closed: either way it is not served
        worker.join(60)
        assert result["status"] == 200
        assert result["body"]["usage"]["completion_tokens"] == 200
        # uvicorn re-raises the SIGTERM it drained on, the conventional exit status for it.
        assert server.process.wait(30) in (0, -signal.SIGTERM)
        assert not alive(engine)
    finally:
        server.stop()


def test_garbage_on_the_engine_socket_is_dropped(tiny_dir: Path) -> None:
    from vlmserve.engine.config import EngineConfig
    from vlmserve.engine.core import EngineCore
    from vlmserve.engine.frontend import load_frontend
    from vlmserve.serve.engine_process import EngineLoop
    from vlmserve.serve.messages import AddRequest, SamplingSpec, encoder

    config = EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 20)
    core = EngineCore(config, load_frontend(config))
    sent: list[bytes] = []

    class Push:
        def send(self, data: bytes) -> None:
            sent.append(data)

    loop = EngineLoop(core, None, Push(), os.getppid())  # type: ignore[arg-type]
    for garbage in (
        b"",
        b"\x00\x01\x02",
        np.random.default_rng(0).bytes(512),
        b"\x81\xa4type\xa3add",
        encoder.encode({"type": "add", "request_id": 5}),
    ):
        loop._handle(garbage)
    assert not core.has_unfinished_requests() and sent == []
    spec = SamplingSpec(0.0, 1.0, 0, 3, None, [], False)
    segment = shm.write_array(np.zeros((4, 1176), np.float32))
    bad = AddRequest("r", ["r"], [spec], [1, 2, 3], [])
    loop._handle(encoder.encode(bad))  # a well-formed request is still served
    assert core.has_unfinished_requests()
    shm.unlink(segment.name)
