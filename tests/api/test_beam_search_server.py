"""use_beam_search and length_penalty in the server, through the official openai client, on the
4-token tiny checkpoint of tests/beam_oracle.py: 8 beams over 2 steps keep every live prefix, so
the choices must be the 8 best of all sequences under vLLM's score, best first; length_penalty
alone changes which one wins; a stream carries the same answer; fields beam search would not
apply are refused by name."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from tests.api.conftest import Server, segments_left, start_server
from tests.beam_oracle import EOS, exhaustive

PROMPT = [0]


@pytest.fixture(scope="module")
def small_dir(small_vocab_dir: Path) -> Path:
    return small_vocab_dir  # the session's (tests/conftest.py), shared with the other beam search tests


@pytest.fixture(scope="module")
def small_hf(small_vocab_hf):  # type: ignore[no-untyped-def]
    return small_vocab_hf


@pytest.fixture(scope="module")
def server(small_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(small_dir, tmp_path_factory.mktemp("beam"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def _beams(client: openai.OpenAI, n: int, max_tokens: int, length_penalty: float) -> list[tuple[list[int], str]]:
    reply = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        n=n,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"use_beam_search": True, "length_penalty": length_penalty, "return_token_ids": True},
    )
    assert [c.index for c in reply.choices] == list(range(n))
    return [(c.model_extra["token_ids"], c.finish_reason) for c in reply.choices]  # type: ignore[index]


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_the_choices_are_the_best_beams_in_order(client: openai.OpenAI, small_hf, length_penalty: float) -> None:  # type: ignore[no-untyped-def]
    expected = exhaustive(small_hf, PROMPT, 2, length_penalty)[:8]
    assert min(expected[i][2] - expected[i + 1][2] for i in range(7)) > 1e-4  # no near ties
    got = _beams(client, 8, 2, length_penalty)
    assert len({tuple(ids) for ids, _ in got}) == 8  # distinct
    # The server's ids leave a final eos out (include_stop_str_in_output false), finish_reason says it.
    want = [
        (tokens[len(PROMPT) : -1], "stop") if tokens[-1] == EOS else (tokens[len(PROMPT) :], "length")
        for tokens, _, _ in expected
    ]
    assert got == want


def test_length_penalty_alone_changes_the_winner(client: openai.OpenAI) -> None:
    short = _beams(client, 4, 2, -4.0)[0]
    long = _beams(client, 4, 2, 4.0)[0]
    assert short == ([], "stop")  # eos at once: the shortest length
    assert len(long[0]) == 2 and long[1] == "length"


def test_a_stream_carries_the_same_beams(server: Server, client: openai.OpenAI) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "n": 3, "max_tokens": 2, "temperature": 0, "use_beam_search": True}
    whole = server.post("/v1/completions", body).json()
    reply = server.post("/v1/completions", {**body, "stream": True})
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts = {i: "" for i in range(3)}
    finish = {}
    for event in map(json.loads, events[:-1]):
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
            finish[choice["index"]] = choice["finish_reason"] or finish.get(choice["index"])
    assert [texts[i] for i in range(3)] == [c["text"] for c in whole["choices"]]
    assert [finish[i] for i in range(3)] == [c["finish_reason"] for c in whole["choices"]]


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"stop": ["$"]}, "stop"), ({"logit_bias": {"1": 5}}, "logit_bias"), ({"top_p": 0.5}, "top_p"), ({"n": 11}, "n")],
)
def test_fields_beam_search_would_not_apply_are_refused(server: Server, fields: dict[str, object], param: str) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "use_beam_search": True, **fields}
    reply = server.post("/v1/completions", body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_length_penalty_must_be_finite(server: Server) -> None:
    reply = server.post("/v1/completions", {"model": "tiny", "prompt": PROMPT, "length_penalty": 1e300})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "length_penalty"


def _metric(server: Server, name: str) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _wait_until(done: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"after {timeout:g} s: {what}"
        time.sleep(0.05)


def test_a_client_leaving_ends_its_search(server: Server) -> None:
    """A search of 4000 steps, its client gone during it: the search stops (nothing left running
    or waiting in the engine, the request no longer in flight), no error, no segment left."""
    start = len(server.log.read_bytes())
    body = {"model": "tiny", "prompt": PROMPT, "n": 8, "max_tokens": 4000, "ignore_eos": True, "use_beam_search": True}
    payload = json.dumps(body).encode()
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(payload)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in server.headers.items())
    sock.sendall((head + "\r\n").encode() + payload)
    try:
        _wait_until(lambda: _metric(server, "vllm:prefix_cache_queries_total") > 50, "the search never ran")
    finally:
        sock.close()
    _wait_until(
        lambda: (
            _metric(server, "vlmserve_requests_in_flight") == 0
            and _metric(server, "vllm:num_requests_running") == 0
            and _metric(server, "vllm:num_requests_waiting") == 0
        ),
        "the search went on",
    )
    assert "Traceback" not in server.log.read_bytes()[start:].decode()
    assert server.health() == 200
    assert segments_left() == []


def test_a_forced_tool_call_is_refused_with_beam_search(server: Server) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "use_beam_search": True}
    reply = server.post("/v1/chat/completions", {**body, "tools": [tool], "tool_choice": "required"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "tool_choice"
