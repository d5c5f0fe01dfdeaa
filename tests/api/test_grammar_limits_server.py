"""Structured-output grammars against the real server (docs/security.md, "Structured outputs:
one grammar that stalls everyone" and "Compiled grammars that are never freed"): a spec over
--max-grammar-bytes is a 400 from the API process; a grammar that compiles for long holds up no
other request and past --max-grammar-compile-seconds is a 400; distinct schemas by the hundred
keep the engine's memory within --grammar-cache-gib. After each, /health is 200 and the engine
keeps its PID."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import Server, start_server
from vlmserve.api.protocol import APIError, ChatCompletionRequest, CompletionRequest
from vlmserve.sampling_params import SamplingParams

MAX_BYTES = 200_000
COMPILE_SECONDS = 1.5
CACHE_GIB = 0.05  # 53.7 MB: seven 7 MB grammars (the smallest JSON schema under Qwen's vocabulary)


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        tiny_dir,
        tmp_path_factory.mktemp("grammar-limits"),
        "--max-grammar-bytes",
        str(MAX_BYTES),
        "--max-grammar-compile-seconds",
        str(COMPILE_SECONDS),
        "--grammar-cache-gib",
        str(CACHE_GIB),
    )
    yield s
    s.stop()


def chat(server: Server, **fields: object) -> tuple[httpx.Response, float]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}
    start = time.monotonic()
    response = server.post("/v1/chat/completions", body | fields)
    return response, time.monotonic() - start


def schema_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def optional_properties(count: int) -> dict:
    """An object of `count` optional integer properties: xgrammar's compile grows faster than the
    text (1,000: 29 kB, 0.17 s of CPU; 3,000: 89 kB, 0.84 s; 10,000: 299 kB, 36 s, on the
    development machine, AMD EPYC). Deep nesting, the other slow kind, is refused before it gets
    here (128 levels at most in a request body)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(count)}}


def engine_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_spec_over_the_byte_limit_is_a_400_naming_the_flag(server: Server) -> None:
    pid = server.engine_pid()
    many = optional_properties(10_000)  # 299 kB
    response, _ = chat(server, **schema_format(many))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format"
    assert f"more than the {MAX_BYTES} allowed (max_grammar_bytes, --max-grammar-bytes)" in error["message"]
    response, _ = chat(server, guided_regex="a" * (MAX_BYTES + 1))
    assert response.status_code == 400 and response.json()["error"]["param"] == "guided_regex"
    assert server.health() == 200 and server.engine_pid() == pid


def test_the_byte_limit_names_the_field_the_grammar_comes_from() -> None:
    """The field the request used, a forced tool call's schema counted as `tools`."""
    defaults = SamplingParams()
    choice = CompletionRequest(prompt="x", guided_choice=["yes", "no"])  # '["yes", "no"]': 13 bytes
    assert choice.sampling_params(defaults, 4, None, 1, max_grammar_bytes=13).structured_outputs is not None
    with pytest.raises(APIError, match=r"guided_choice is 13 bytes, more than the 12 allowed") as info:
        choice.sampling_params(defaults, 4, None, 1, max_grammar_bytes=12)
    assert info.value.param == "guided_choice"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    forced = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[tool], tool_choice="required")
    with pytest.raises(APIError, match=r"tools is \d+ bytes, more than the 10 allowed") as info:
        forced.sampling_params(defaults, 4, None, 1, max_grammar_bytes=10)
    assert info.value.param == "tools"


def test_a_long_compile_holds_up_no_one_and_past_its_limit_is_a_400(server: Server) -> None:
    pid = server.engine_pid()
    chat(server)
    alone = statistics.median(chat(server)[1] for _ in range(3))
    with ThreadPoolExecutor(1) as pool:
        attack = pool.submit(chat, server, **schema_format(optional_properties(6_000)))  # 178 kB
        time.sleep(0.3)
        beside = [chat(server)[1] for _ in range(3)]
        response, attack_s = attack.result()
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert f"took more than {COMPILE_SECONDS:g} s of CPU time" in message
    assert "--max-grammar-compile-seconds" in message
    # The compile ran for at least its CPU limit; the plain requests beside it took as long as alone
    # (before, they waited for the whole compile: 4.1 s against 0.03 s alone, beside 500 nested
    # arrays, which the body's depth limit now refuses first).
    assert attack_s >= COMPILE_SECONDS
    assert max(beside) < max(0.5, 5 * alone) and max(beside) < attack_s / 3, (alone, beside, attack_s)
    # The abandoned compile runs on in its thread; another grammar compiles on the other one.
    ok, _ = chat(server, guided_choice=["fine"])
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"
    assert server.health() == 200 and server.engine_pid() == pid


def test_distinct_schemas_keep_the_engine_within_its_grammar_cache(server: Server) -> None:
    """Each distinct small schema compiles to 7 MB; on main 120 of them grew the engine by 800 MB."""
    pid = server.engine_pid()

    def one(i: int) -> None:
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        response, _ = chat(server, max_tokens=3, **schema_format(schema))
        assert response.status_code == 200, response.text

    for i in range(10):  # the cache full once
        one(i)
    before = engine_rss(pid)
    for i in range(10, 110):
        one(i)
    grown = engine_rss(pid) - before
    assert grown < 40 << 20, f"the engine grew by {grown / (1 << 20):.0f} MiB over 100 schemas"
    assert server.health() == 200 and server.engine_pid() == pid
