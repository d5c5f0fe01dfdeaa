"""One request is counted by what it makes the engine run, not as one HTTP request: its sequences
at once (prompts x n, beams too) within --max-seqs-per-request (default half of --max-num-seqs),
and the prompt tokens it has scored over the whole vocabulary (prompt_logprobs) within
--max-prompt-logprobs-tokens; past either, a 400 naming the numbers and the flag, and the
engine never sees it. Within the bounds, the engine shares its sequences among HTTP requests:
a plain request does not queue behind another request's sequences."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import Server, start_server

LOGPROB_TOKENS = 50


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # start_server runs --max-num-seqs 16: one request may run 8 sequences.
    s = start_server(tiny_dir, tmp_path_factory.mktemp("cost"), "--max-prompt-logprobs-tokens", str(LOGPROB_TOKENS))
    yield s
    s.stop()


def completion(server: Server, **fields: object) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 2, "temperature": 0} | fields
    response = server.post("/v1/completions", body)
    return response.status_code, response.json()


@pytest.mark.parametrize(
    ("fields", "sequences", "shape"),
    [
        ({"prompt": ["a b"] * 8, "n": 2}, 16, "8 prompt(s) x n 2"),
        ({"prompt": ["a b"] * 3, "n": 3, "use_beam_search": True}, 9, "3 prompt(s) x n 3"),
    ],
)
def test_too_many_sequences_in_one_request_is_a_400(server: Server, fields: dict, sequences: int, shape: str) -> None:
    pid = server.engine_pid()
    status, body = completion(server, **fields)
    assert status == 400, body
    message = body["error"]["message"]
    assert f"asks for {sequences} sequences at once ({shape}), more than the 8 one request may run" in message
    assert "--max-seqs-per-request" in message and body["error"]["param"] == "prompt"
    assert server.health() == 200 and server.engine_pid() == pid


def test_up_to_the_bound_is_served(server: Server) -> None:
    status, body = completion(server, prompt=["a b"] * 4, n=2)
    assert status == 200 and len(body["choices"]) == 8, body
    response = server.post(
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 9, "max_tokens": 2},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"  # --max-n 8 first
    response = server.post(
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 8, "max_tokens": 2},
    )
    assert response.status_code == 200 and len(response.json()["choices"]) == 8


def test_prompt_logprobs_are_counted_in_prompt_tokens_for_each_sample(server: Server) -> None:
    words = " ".join(["word"] * 30)  # about 30 tokens
    status, body = completion(server, prompt=words, prompt_logprobs=1)
    assert status == 200, body
    status, body = completion(server, prompt=words, prompt_logprobs=1, n=2)
    assert status == 400, body
    assert body["error"]["param"] == "prompt_logprobs"
    message = body["error"]["message"]
    assert f"more than the {LOGPROB_TOKENS} allowed (--max-prompt-logprobs-tokens)" in message
    tokens = server.post("/tokenize", {"model": "tiny", "prompt": words}).json()["count"]
    assert f"prompt_logprobs would score {2 * tokens} prompt tokens" in message
    status, body = completion(server, prompt=[words, words], prompt_logprobs=1)
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"
    assert server.health() == 200


def test_a_plain_request_is_not_queued_behind_another_requests_sequences(server: Server) -> None:
    """H1 and H2 (8 sequences each, 1,500 tokens) take all 16 places; H3's 8 wait; then a plain
    request comes. It has nothing running, so the newest sequence of a request running the most
    makes room for it: it is answered while H1 and H2 still run. First come first served left it
    behind H3 until H1 and H2 ended (on the scheduler before, H1 had finished when it was
    answered)."""

    async def scenario() -> tuple[bool, bool]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=300) as client:
            started = {name: asyncio.Event() for name in ("h1", "h2", "h3")}
            finished = {name: asyncio.Event() for name in ("h1", "h2", "h3")}

            async def heavy(name: str) -> None:
                body = {"model": "tiny", "prompt": ["a b"] * 8, "max_tokens": 1500, "ignore_eos": True}
                async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
                    assert response.status_code == 200
                    async for _line in response.aiter_lines():
                        started[name].set()
                finished[name].set()

            tasks = [asyncio.create_task(heavy("h1"))]
            await started["h1"].wait()
            tasks.append(asyncio.create_task(heavy("h2")))
            await started["h2"].wait()
            tasks.append(asyncio.create_task(heavy("h3")))
            await asyncio.sleep(0.5)  # H3 queued in the engine
            plain = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            response = await client.post("/v1/chat/completions", json=plain)
            assert response.status_code == 200, response.text
            running = not finished["h1"].is_set(), not finished["h2"].is_set()
            for task in tasks:  # the clients go away: the engine aborts what is left
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return running

    pid = server.engine_pid()
    assert asyncio.run(scenario()) == (True, True), "the plain request waited for H1 or H2 to end"
    assert server.health() == 200 and server.engine_pid() == pid
