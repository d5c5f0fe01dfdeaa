"""Processes and cancellation (BAD_INPUTS 21-28) against real servers: clients that go away,
an engine that dies, an API process that dies, SIGTERM, overload, a crashed run's segments.

What the engine holds is read from its own numbers: the running and waiting gauges and the
KV-cache usage on /metrics are the engine process's latest stats message, sent every
STATS_INTERVAL_S (0.5 s) between steps. One read may be that old, so a test never trusts a
single read: it waits (with a deadline) for the engine to report the request it is about to
drop, then for a later report without it. Stats arrive in the order they are sent. That an
aborted request never ran afterwards (it might finish by itself before any deadline) is read
from the engine's counters of requests taken off its queue and of images looked up."""

from __future__ import annotations

import http.server
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

import httpx
import msgspec
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import Server, data_url, image_message, picture, segments_left, start_server
from vlmserve.ipc import shm

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}
# On the one-at-a-time server: 8 samples of 3000 tokens run one after another, for far longer
# than a test holds them, so what queues behind such a request stays queued.
BUSY = {**LONG, "n": 8}
GAUGES = {
    "running": "vlmserve_num_requests_running",  # the engine's
    "waiting": "vlmserve_num_requests_waiting",  # the engine's
    "kv": "vlmserve_kv_cache_usage_ratio",  # the engine's
    "in_flight": "vlmserve_requests_in_flight",  # the API process's own, always current
    # The engine's, since it started. Prompt tokens looked up in the prefix cache: they grow
    # each time a request is taken off the queue to run.
    "admitted_tokens": "vlmserve_prefix_cache_queries",
    # Once per (request, image) scheduled, unless the image's placeholders are all in the
    # prefix cache: an unseen picture is looked up when, and only when, its request runs.
    "encoder_hits": "vlmserve_encoder_cache_hits",
    "encoder_misses": "vlmserve_encoder_cache_misses",
}
IDLE = {"running": 0.0, "waiting": 0.0, "kv": 0.0, "in_flight": 0.0}


def idle(state: dict[str, float]) -> bool:
    return {key: state[key] for key in IDLE} == IDLE


def image_lookups(state: dict[str, float]) -> float:
    return state["encoder_hits"] + state["encoder_misses"]


def metric(server: Server, name: str) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def engine_state(server: Server) -> dict[str, float]:
    """The gauges of GAUGES from one /metrics read (so the engine's are one snapshot; their one
    label is engine="0", the only engine)."""
    values = {}
    for line in server.get("/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        values[name.removesuffix('{engine="0"}')] = value
    return {key: float(values[name]) for key, name in GAUGES.items()}


def wait_until(done: Callable[[], bool], failure: Callable[[], str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout:g} s: {failure()}")
        time.sleep(0.05)


def wait_for_state(
    server: Server, what: str, ok: Callable[[dict[str, float]], bool], timeout: float = 30.0
) -> dict[str, float]:
    """The first state read that satisfies `ok`; fails naming `what` and the last state read."""
    state: dict[str, float] = {}

    def check() -> bool:
        state.update(engine_state(server))
        return ok(state)

    wait_until(check, lambda: f"the engine never reported {what}; last read: {state}", timeout)
    return dict(state)


def wait_idle(server: Server, timeout: float = 30.0) -> dict[str, float]:
    """The engine runs and queues nothing and holds no KV block; the API serves nothing."""
    return wait_for_state(server, "running nothing and holding no KV block", idle, timeout)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has exited


class RawRequest:
    """A chat completion POSTed on a connection of its own that the test drops when it likes:
    a client that goes away without reading the answer."""

    def __init__(self, server: Server, body: dict) -> None:
        host, port = server.url.removeprefix("http://").split(":")
        payload = json.dumps(body).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in server.headers.items()) + "\r\n"
        )
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        self.sock.sendall(head.encode() + payload)

    def answered(self) -> bool:
        """Whether any byte of an answer (or the connection's end) has arrived; never waits."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        return bool(readable)

    def leave(self) -> None:
        self.sock.close()


class StreamReader(threading.Thread):
    """Reads one streamed chat completion to its end in the background: every JSON event, and
    whether `data: [DONE]` came."""

    def __init__(self, server: Server, body: dict, on_first_token: Callable[[], None] | None = None) -> None:
        super().__init__(daemon=True)
        self.server, self.body = server, body
        self.on_first_token = on_first_token
        self.events: list[dict] = []
        self.done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with (
                httpx.Client(timeout=120) as client,
                client.stream(
                    "POST",
                    self.server.url + "/v1/chat/completions",
                    json={**self.body, "stream": True},
                    headers=self.server.headers,
                ) as response,
            ):
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        if self.on_first_token is not None and self.tokens() > 0:
                            self.on_first_token()
                            self.on_first_token = None
        except Exception as e:  # the test reads it
            self.error = e

    def tokens(self) -> int:
        """Tokens received so far: one logprobs entry each (the body asks for logprobs)."""
        return sum(
            len(choice["logprobs"]["content"])
            for event in list(self.events)
            for choice in event.get("choices", [])
            if choice.get("logprobs")
        )

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in list(self.events) for c in e.get("choices", []) if c.get("finish_reason")]


# /released.png: held until the test sets this, then sent whole.
IMAGE_RELEASED = threading.Event()


class HoldingHost(http.server.BaseHTTPRequestHandler):
    """A media host that sends the start of a 1000-byte image, then holds the connection open
    until the fetcher hangs up. Each GET appends an Event to `fetches`, set once its fetcher
    has closed the connection. /released.png is sent whole once IMAGE_RELEASED is set."""

    fetches: ClassVar[list[threading.Event]]

    def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
        pass

    def do_GET(self) -> None:
        closed = threading.Event()
        self.fetches.append(closed)
        if self.path == "/released.png":
            IMAGE_RELEASED.wait(60)
            image = io.BytesIO()
            picture(21).save(image, format="PNG")
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(image.getvalue())))
            self.end_headers()
            self.wfile.write(image.getvalue())
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b"\x89PNG\r\n\x1a\n")
        self.wfile.flush()
        self.connection.settimeout(600)
        try:
            while self.connection.recv(1024):
                pass
        except OSError:
            return  # still open when the host gave up
        closed.set()


@pytest.fixture(scope="module")
def host() -> Iterator[tuple[int, list[threading.Event]]]:
    fetches: list[threading.Event] = []
    handler = type("Host", (HoldingHost,), {"fetches": fetches})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1], fetches
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def small(
    tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory, host: tuple[int, list[threading.Event]]
) -> Iterator[Server]:
    """One request runs at a time, two in flight at most; media may be fetched from `host`
    (for up to 120 s: far longer than any test waits)."""
    s = start_server(
        tiny_dir,
        tmp_path_factory.mktemp("small"),
        "--max-num-seqs",
        "1",
        "--max-queue",
        "2",
        "--allow-media-network",
        f"127.0.0.1/32:{host[0]}",
        "--media-fetch-timeout",
        "120",
    )
    yield s
    s.stop()


def has_content(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    return any(choice["delta"].get("content") for choice in json.loads(line[6:]).get("choices", []))


def test_client_leaving_mid_stream_frees_every_sample_in_the_engine(small: Server) -> None:
    wait_idle(small)
    body = {"messages": image_message(data_url(picture(5))), **LONG, "n": 3, "stream": True}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", small.url + "/v1/chat/completions", json=body, headers=small.headers) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if has_content(line):
                # Sample 0 runs and holds KV blocks (image and text), samples 1 and 2 wait.
                busy = wait_for_state(
                    small,
                    "one sample running on KV blocks, two queued",
                    lambda s: (s["running"], s["waiting"]) == (1, 2) and s["kv"] > 0,
                )
                break  # the client goes away mid-stream
    after = wait_idle(small)
    # Samples 1 and 2 were aborted in the queue: none was taken off it to run.
    assert after["admitted_tokens"] == busy["admitted_tokens"]
    assert segments_left() == []


def test_client_leaving_a_non_streamed_request_frees_its_kv_blocks(small: Server) -> None:
    wait_idle(small)
    request = RawRequest(small, {"messages": [{"role": "user", "content": "go"}], **BUSY})
    try:
        busy = wait_for_state(
            small,
            "one sample running on KV blocks, seven queued",
            lambda s: (s["running"], s["waiting"]) == (1, 7) and s["kv"] > 0,
        )
        assert not request.answered()
    finally:
        request.leave()
    after = wait_idle(small)
    # The seven queued samples were aborted in the queue: none was taken off it to run.
    assert after["admitted_tokens"] == busy["admitted_tokens"]


def test_client_leaving_while_queued_leaves_the_engine_queue(small: Server) -> None:
    wait_idle(small)
    first = RawRequest(small, {"messages": [{"role": "user", "content": "a"}], **BUSY})
    second = None
    try:
        wait_for_state(small, "the first request's samples", lambda s: (s["running"], s["waiting"]) == (1, 7))
        # Behind seven samples of 3000 tokens: it cannot be scheduled while the test runs.
        second = RawRequest(small, {"messages": image_message(data_url(picture(11))), **LONG})
        queued = wait_for_state(small, "the second request queued", lambda s: (s["running"], s["waiting"]) == (1, 8))
        second.leave()
        wait_until(lambda: engine_state(small)["in_flight"] == 1, lambda: "the API still serves the second request")
        assert not first.answered()
    finally:
        first.leave()
        if second is not None:
            second.leave()
    after = wait_idle(small)
    # The second request's picture, seen nowhere before, was never looked up: the second request
    # never ran, its abort took it off the queue.
    assert image_lookups(after) == image_lookups(queued)


def test_client_leaving_while_its_media_is_fetched_ends_the_fetch(
    small: Server, host: tuple[int, list[threading.Event]]
) -> None:
    port, fetches = host
    wait_idle(small)
    before = len(fetches)
    request = RawRequest(small, {"messages": image_message(f"http://127.0.0.1:{port}/held.png"), **LONG})
    try:
        wait_until(lambda: len(fetches) > before, lambda: "the server never fetched the image")
    finally:
        request.leave()
    # Left alone, the fetch would wait for the rest of the image until its 120 s timeout.
    wait_until(fetches[-1].is_set, lambda: "the server kept fetching for a client that had gone")
    wait_idle(small)
    assert segments_left() == []


def test_past_the_queue_limit_429_without_waiting_for_a_slot(small: Server) -> None:
    wait_idle(small)
    held = []
    try:
        held.append(RawRequest(small, {"messages": [{"role": "user", "content": "a"}], **BUSY}))
        held.append(RawRequest(small, {"messages": [{"role": "user", "content": "b"}], **LONG}))
        wait_for_state(small, "both requests in the engine", lambda s: (s["running"], s["waiting"]) == (1, 8))
        response = small.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "y"}], "max_tokens": 2})
        assert response.status_code == 429
        assert response.json()["error"]["type"] == "rate_limit_error"
        # Refused while both requests ahead of it still go on: it never waited for a slot.
        assert not any(r.answered() for r in held)
    finally:
        for r in held:
            r.leave()
    wait_idle(small)
    assert small.health() == 200


def vllm_series(server: Server) -> dict[str, float]:
    """/metrics parsed as Prometheus parses it: each vllm:* sample by name (labels other than
    model_name and engine joined on, e.g. 'vllm:request_success_total{finished_reason=length}')."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("vllm:") and "le" not in sample.labels:
                extra = ",".join(
                    f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("model_name", "engine")
                )
                out[sample.name + (f"{{{extra}}}" if extra else "")] = sample.value
    return out


def test_a_request_queued_behind_the_full_batch_shows_its_wait_in_vllm_s_queue_time(small: Server) -> None:
    wait_idle(small)
    before = vllm_series(small)
    first = RawRequest(small, {"messages": [{"role": "user", "content": "a"}], **LONG})
    second = StreamReader(
        small, {"messages": [{"role": "user", "content": "b"}], "max_tokens": 3, "ignore_eos": True, "logprobs": True}
    )
    try:
        wait_for_state(small, "the first request running", lambda s: (s["running"], s["waiting"]) == (1, 0))
        second.start()
        wait_for_state(small, "the second queued behind it", lambda s: (s["running"], s["waiting"]) == (1, 1))
        # The second was queued before this; it cannot run before the first leaves, which it
        # does once the first has made 20 more tokens.
        queued_by = time.monotonic()
        made = vllm_series(small)["vllm:generation_tokens_total"]
        wait_until(
            lambda: vllm_series(small)["vllm:generation_tokens_total"] >= made + 20,
            lambda: "the first request stopped making tokens",
        )
        left_at = time.monotonic()
    finally:
        first.leave()
    second.join(60)
    assert second.done and second.error is None and second.tokens() == 3
    after = vllm_series(small)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    # Only the second finished (the first, left by its client, is recorded nowhere).
    assert delta["vllm:request_queue_time_seconds_count"] == 1
    assert delta["vllm:request_success_total{finished_reason=length}"] == 1
    queue = delta["vllm:request_queue_time_seconds_sum"]
    assert queue >= left_at - queued_by > 0
    prefill, decode = delta["vllm:request_prefill_time_seconds_sum"], delta["vllm:request_decode_time_seconds_sum"]
    inference = delta["vllm:request_inference_time_seconds_sum"]
    assert prefill > 0 and decode > 0 and abs(prefill + decode - inference) < 1e-6
    # From its arrival: the wait and the prefill are inside its time to first token, and all of it inside e2e.
    assert delta["vllm:time_to_first_token_seconds_sum"] >= queue + prefill
    assert delta["vllm:e2e_request_latency_seconds_sum"] >= queue + inference
    # Every token either request computed went through some step, each step observed once; the
    # prompts ("a", "b": as long) counted when their first token came.
    assert delta["vllm:iteration_tokens_total_sum"] == (
        delta["vllm:prompt_tokens_total"] + delta["vllm:generation_tokens_total"]
    )
    assert delta["vllm:prompt_tokens_total"] == 2 * delta["vllm:request_prompt_tokens_sum"]
    assert delta["vllm:generation_tokens_total"] >= 20 + 3
    assert delta["vllm:request_params_max_tokens_sum"] == 3 and delta["vllm:request_params_n_sum"] == 1
    wait_idle(small)


def test_time_to_first_token_and_e2e_run_from_arrival_through_the_media_fetch(
    small: Server, host: tuple[int, list[threading.Event]]
) -> None:
    port, fetches = host
    wait_idle(small)
    before = vllm_series(small)
    fetched = len(fetches)
    IMAGE_RELEASED.clear()
    body = {"messages": image_message(f"http://127.0.0.1:{port}/released.png"), "max_tokens": 2, "logprobs": True}
    reader = StreamReader(small, {**body, "ignore_eos": True})
    reader.start()
    try:
        wait_until(lambda: len(fetches) > fetched, lambda: "the server never fetched the image")
        fetch_seen = time.monotonic()  # the request arrived before this
        time.sleep(1.0)  # not a wait for a state: a span the request's TTFT must hold
        released = time.monotonic()
    finally:
        IMAGE_RELEASED.set()
    reader.join(60)
    assert reader.done and reader.error is None and reader.tokens() == 2
    after = vllm_series(small)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["vllm:time_to_first_token_seconds_count"] == 1
    # Its first token came after the image did; vLLM times it from arrival, not from when the
    # processed prompt reached the engine (which would leave the fetch out).
    assert delta["vllm:time_to_first_token_seconds_sum"] >= released - fetch_seen
    assert delta["vllm:e2e_request_latency_seconds_sum"] >= (
        released - fetch_seen + delta["vllm:request_inference_time_seconds_sum"]
    )
    wait_idle(small)


@pytest.mark.slow
def test_engine_death_errors_in_flight_then_restarts(tiny_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_dir, tmp_path)
    try:
        reader = StreamReader(server, {"messages": [{"role": "user", "content": "x"}], **LONG, "logprobs": True})
        reader.start()
        wait_until(
            lambda: reader.tokens() >= 5 or not reader.is_alive(),
            lambda: f"5 tokens not streamed; {reader.tokens()} came",
            timeout=60,
        )
        assert reader.tokens() >= 5, f"the stream ended early: {reader.error!r} {reader.events[-1:]}"
        wait_for_state(server, "the request running on KV blocks", lambda s: s["running"] == 1 and s["kv"] > 0)
        engine = server.engine_pid()
        os.kill(engine, signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive(), "the stream hung after the engine died"
        assert "error" in reader.events[-1] and reader.events[-1]["error"]["type"] == "service_unavailable"
        assert reader.done
        # The dead engine's last numbers are gone: nothing runs, nothing holds KV blocks.
        state = engine_state(server)
        assert idle(state), state
        wait_until(lambda: server.health() != 200, lambda: "/health still answers 200 with the engine dead", 10)
        refused = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert refused.status_code == 503
        server.wait_healthy(60)  # restarted
        assert server.engine_pid() != engine
        ok = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
        assert ok.status_code == 200
        wait_idle(server)
        assert metric(server, "vlmserve_engine_restarts") == 1
        assert segments_left() == []
    finally:
        server.stop()


@pytest.mark.slow
def test_api_process_death_ends_the_engine(tiny_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_dir, tmp_path)
    engine = server.engine_pid()
    server.process.kill()
    server.process.wait()
    deadline = time.monotonic() + 5
    while alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(engine)


DRAINED_TOKENS = 100


@pytest.mark.slow
def test_start_sweeps_orphan_segments_and_sigterm_drains_in_flight_streams_and_refuses_new(
    tiny_dir: Path, tmp_path: Path
) -> None:
    # A crashed run left a segment behind: the next start sweeps it.
    code = "import numpy as np; from vlmserve.ipc import shm; print(shm.write_array(np.ones(8, np.float32)).name)"
    orphan = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert orphan in shm.list_segments()
    server = start_server(tiny_dir, tmp_path)
    assert orphan not in shm.list_segments()
    engine = server.engine_pid()
    body = {
        "max_tokens": DRAINED_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": True,
        "stream_options": {"include_usage": True},
    }
    # `started` has tokens when the engine is frozen (SIGSTOP, sent the moment its first token
    # arrives); `pending` is admitted while the engine is frozen, so it provably has not one
    # token computed when SIGTERM comes. Both must then be streamed to their last token.
    started = StreamReader(
        server,
        body | {"messages": [{"role": "user", "content": "x"}]},
        on_first_token=lambda: os.kill(engine, signal.SIGSTOP),
    )
    pending = StreamReader(server, body | {"messages": [{"role": "user", "content": "y"}]})
    try:
        started.start()
        wait_until(lambda: started.tokens() > 0, lambda: f"no token streamed: {started.error!r}", timeout=60)
        wait_until(
            lambda: "\nState:\tT" in Path(f"/proc/{engine}/status").read_text(),
            lambda: "the engine process did not stop on SIGSTOP",
        )
        pending.start()
        wait_until(lambda: len(pending.events) > 0, lambda: f"the second stream never started: {pending.error!r}")
        assert pending.tokens() == 0
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: server.health() != 200, lambda: "/health still answers 200 after SIGTERM", 10)
        try:
            late = httpx.post(
                server.url + "/v1/chat/completions",
                headers=server.headers,
                json={"messages": [{"role": "user", "content": "late"}], "max_tokens": 2},
                timeout=10,
            )
            assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            pass  # or the listener is already closed: either way it is not served
        os.kill(engine, signal.SIGCONT)
        for reader in (started, pending):
            reader.join(120)
            assert not reader.is_alive(), "a stream hung during the drain"
            assert reader.error is None and reader.done
            assert reader.finish_reasons() == ["length"]
            assert reader.tokens() == DRAINED_TOKENS
            assert reader.events[-1]["usage"]["completion_tokens"] == DRAINED_TOKENS
        # uvicorn re-raises the SIGTERM it drained on, the conventional exit status for it.
        assert server.process.wait(30) in (0, -signal.SIGTERM)
        assert not alive(engine)
        ipc_dirs = list(Path(tempfile.gettempdir()).glob(f"vlmserve-ipc-{server.process.pid}-*"))
        assert not ipc_dirs, f"the engine sockets' directory outlived the server: {ipc_dirs}"
    finally:
        if alive(engine):
            os.kill(engine, signal.SIGCONT)
        server.stop()


def test_garbage_on_the_engine_socket_is_dropped(tiny_dir: Path) -> None:
    from vlmserve.engine.checkpoint import load_engine_model
    from vlmserve.engine.config import EngineConfig
    from vlmserve.engine.core import EngineCore
    from vlmserve.engine.engine_process import EngineLoop
    from vlmserve.ipc.messages import AddRequest, encoder
    from vlmserve.multimodal.inputs import ProcessedPrompt
    from vlmserve.sampling_params import SamplingParams

    config = EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 20)
    core = EngineCore(config, load_engine_model(config, [151645]))
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
        # Sampling parameters the engine cannot represent are refused while decoding.
        encoder.encode(
            {
                "type": "add",
                "request_id": "r",
                "child_ids": ["r"],
                "params": [{"temperature": -1.0, "stop_strings": []}],
                "prompt": {"prompt_token_ids": [1], "mm_items": [], "mrope_positions": None, "mrope_delta": 0},
                "segments": [],
            }
        ),
        # A tensor extension whose bytes do not match its shape.
        encoder.encode(
            {
                "type": "add",
                "request_id": "r",
                "child_ids": ["r"],
                "params": [],
                "prompt": {
                    "prompt_token_ids": [1],
                    "mm_items": [],
                    "mrope_positions": msgspec.msgpack.Ext(1, b"\x03\x01" + (5).to_bytes(8, "little")),
                    "mrope_delta": 0,
                },
                "segments": [],
            }
        ),
    ):
        loop._handle(garbage)
    assert not core.has_unfinished_requests() and sent == []
    spec = SamplingParams(temperature=0.0, max_tokens=3)
    segment = shm.write_array(np.zeros((4, 1176), np.float32))
    bad = AddRequest("r", ["r"], [spec], ProcessedPrompt([1, 2, 3], [], None, 0), [])
    loop._handle(encoder.encode(bad))  # a well-formed request is still served
    assert core.has_unfinished_requests()
    shm.unlink(segment.name)
