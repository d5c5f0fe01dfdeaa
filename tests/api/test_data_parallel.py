"""`vlmserve serve --data-parallel-size 2`: one API process, two engine processes, started once
for the module. Greedy answers under load equal the answers alone, whichever engine gave them,
and the load spreads over both (vLLM's per-engine series on /metrics say how much), while a
picture sent again goes back to the engine whose prefix cache holds it. An engine
killed fails its own request in flight only; the other serves on while it restarts (held stopped
by the test, so that "while" is certain), then both serve again. Nothing is left behind: no
shared-memory segment, no socket folder.

Engine k's process is found as vLLM users find theirs: among the server's children, by its
command line (`--engine-index k`); its index is in its log lines too ("[engine k]")."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import API_KEY, Server, data_url, image_message, picture, segments_left, start_server
from tests.api.test_faults import StreamReader, alive, wait_until
from vlmserve.api.dp_client import engine_configs
from vlmserve.engine.config import EngineConfig
from vlmserve.engine.memory import default_budget

TOKENS = 4
BLOCK_SIZE = 16  # the KV cache's (EngineConfig.block_size)


@pytest.fixture(scope="module")
def dp_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tiny_dir, tmp_path_factory.mktemp("dp-server"), "--data-parallel-size", "2")
    yield server
    server.stop()


def engine_pid(server: Server, index: int) -> int:
    children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children").read_text().split()
    for pid in children:
        with_args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"vlmserve.engine.engine_process" in with_args and with_args[with_args.index(b"--engine-index") + 1] == (
            str(index).encode()
        ):
            return int(pid)
    raise AssertionError(f"no engine {index} among the server's children")


def per_engine(server: Server) -> dict[str, list[float]]:
    """Engine 0's and engine 1's: requests finished (every finish reason), ready, restarts."""
    out = {"finished": [0.0, 0.0], "ready": [0.0, 0.0], "restarts": [0.0, 0.0]}
    names = {"vllm:request_success_total": "finished", "vlmserve_engine_ready": "ready"}
    names["vlmserve_engine_restarts"] = "restarts"
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            if sample.name in names:
                out[names[sample.name]][int(sample.labels["engine"])] += sample.value
    return out


def requests() -> list[list[dict]]:
    """16 conversations: 12 texts, 4 pictures."""
    texts = [[{"role": "user", "content": f"Question {i}: {'why ' * i}?"}] for i in range(12)]
    return texts + [image_message(data_url(picture(seed)), "What is it?") for seed in range(4)]


async def answers(server: Server, conversations: list[list[dict]], together: bool) -> list[str]:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    try:

        async def ask(messages: list[dict]) -> str:
            reply = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            assert reply.usage is not None and reply.usage.completion_tokens == TOKENS
            return reply.choices[0].message.content or ""

        if together:
            return list(await asyncio.gather(*(ask(m) for m in conversations)))
        return [await ask(m) for m in conversations]
    finally:
        await client.close()


async def cached_tokens(server: Server, conversations: list[list[dict]]) -> list[tuple[int, int]]:
    """Sent together: each one's prompt tokens, and those the prefix cache of its engine held."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    try:

        async def ask(messages: list[dict]) -> tuple[int, int]:
            reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            return reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens or 0

        return list(await asyncio.gather(*(ask(m) for m in conversations)))
    finally:
        await client.close()


def test_32_concurrent_requests_answer_as_alone_and_spread_over_both_engines(dp_server: Server) -> None:
    conversations = requests()
    alone = asyncio.run(answers(dp_server, conversations, together=False))
    before = per_engine(dp_server)
    assert before["ready"] == [1, 1] and before["restarts"] == [0, 0]
    # Each picture again (in another order, so that taking turns alone would send some to the
    # other engine): its engine's prefix cache has its every full block but the last token's.
    for prompt_tokens, cached in asyncio.run(cached_tokens(dp_server, conversations[12:][::-1])):
        assert cached == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    together = asyncio.run(answers(dp_server, conversations * 2, together=True))
    assert together == alone * 2
    after = per_engine(dp_server)
    moved = [after["finished"][k] - before["finished"][k] for k in range(2)]
    assert sum(moved) == 32 + 4
    assert min(moved) >= 8, f"finished per engine: {moved}"
    assert segments_left() == []


def test_a_killed_engine_fails_its_request_alone_and_the_other_serves_while_it_restarts(dp_server: Server) -> None:
    conversations = requests()[:6]
    expected = asyncio.run(answers(dp_server, conversations, together=False))
    pids = [engine_pid(dp_server, 0), engine_pid(dp_server, 1)]
    long = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100, "ignore_eos": True, "logprobs": True}
    # Two long streams at once: one on each engine (the least loaded takes each).
    readers = [StreamReader(dp_server, {**long, "temperature": 0}) for _ in range(2)]
    for reader in readers:
        reader.start()
    wait_until(lambda: all(r.tokens() >= 2 for r in readers), lambda: f"{[r.tokens() for r in readers]} tokens came")
    os.kill(pids[1], signal.SIGKILL)
    for reader in readers:
        reader.join(60)
        assert not reader.is_alive() and reader.error is None and reader.done
    failed = [r for r in readers if "error" in r.events[-1]]
    assert len(failed) == 1, [r.events[-1] for r in readers]
    assert failed[0].events[-1]["error"]["type"] == "service_unavailable"
    finished = next(r for r in readers if r is not failed[0])
    assert finished.finish_reasons() == ["length"] and finished.tokens() == 100

    # Engine 1 is started again: held stopped while it loads, it cannot be ready.
    wait_until(lambda: per_engine(dp_server)["restarts"][1] == 1, lambda: "engine 1 was not restarted")
    restarted = engine_pid(dp_server, 1)
    assert restarted != pids[1]
    os.kill(restarted, signal.SIGSTOP)
    try:
        state = per_engine(dp_server)
        assert state["ready"] == [1, 0] and state["restarts"] == [0, 1]
        assert dp_server.health() == 200  # one engine serves
        assert asyncio.run(answers(dp_server, conversations, together=True)) == expected
        moved = [per_engine(dp_server)["finished"][k] - state["finished"][k] for k in range(2)]
        assert moved == [6, 0]
    finally:
        os.kill(restarted, signal.SIGCONT)

    wait_until(lambda: per_engine(dp_server)["ready"] == [1, 1], lambda: "engine 1 never got ready", timeout=120)
    state = per_engine(dp_server)
    assert asyncio.run(answers(dp_server, conversations * 2, together=True)) == expected * 2
    moved = [per_engine(dp_server)["finished"][k] - state["finished"][k] for k in range(2)]
    assert sum(moved) == 12 and min(moved) >= 3, f"finished per engine: {moved}"
    assert engine_pid(dp_server, 0) == pids[0] and per_engine(dp_server)["restarts"] == [0, 1]
    assert segments_left() == []


def test_stopped_it_leaves_no_segment_and_no_socket_folder(dp_server: Server) -> None:
    engines = [engine_pid(dp_server, 0), engine_pid(dp_server, 1)]
    dp_server.stop()
    wait_until(lambda: not any(alive(pid) for pid in engines), lambda: "an engine process outlived the server")
    assert segments_left() == []
    assert list(Path(tempfile.gettempdir()).glob(f"vlmserve-ipc-{dp_server.process.pid}-*")) == []


def test_on_the_cpu_engines_split_the_default_budget_and_the_threads() -> None:
    config = EngineConfig(model="m", device="cpu")
    configs, threads = engine_configs(config, 2, 0)
    assert threads == max(1, torch.get_num_threads() // 2)
    budget = configs[0].memory_budget_bytes
    assert budget is not None and configs[1] == configs[0]
    half_of_available = default_budget(torch.device("cpu"))  # a moment later: close, not equal
    assert abs(budget - half_of_available // 2) < half_of_available // 10
    assert engine_configs(config, 1, 0) == ([config], 0)  # one engine: as it was
    given = dataclasses.replace(config, memory_budget_bytes=3 << 30)
    assert engine_configs(given, 2, 3) == ([given, given], 3)  # given: each engine's


def test_shutdown_stops_an_engine_still_loading(tiny_dir: Path) -> None:
    """One engine failing to start stops the others, some still loading, not yet connected to
    their sockets: shutdown must not wait on them (a Shutdown message would wait for ever)."""
    from vlmserve.api.engine_client import EngineClient
    from vlmserve.api.frontend import load_frontend

    config = EngineConfig(model=str(tiny_dir), dtype="float32")
    client = EngineClient(config, load_frontend(config), index=1)
    loading = subprocess.Popen(["sleep", "600"])  # in place of spawn(): never connects, never ready
    client.engine._process = loading
    asyncio.run(asyncio.wait_for(client.shutdown(), 30))
    assert loading.wait(30) == -signal.SIGKILL
    assert not client._dir.exists()
