"""64 concurrent streaming requests with images against the real server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import Server, data_url, image_message, picture, segments_left, start_server
from vlmserve import LLM, SamplingParams

CONCURRENT = 64
MAX_TOKENS = 12


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def stream_one(client: httpx.AsyncClient, server: Server, messages: list) -> str:
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    text = []
    async with client.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.extend(c["delta"].get("content", "") for c in chunk["choices"])
    return "".join(text)


@pytest.mark.slow
def test_64_concurrent_streams_with_images(tiny_dir: Path, tmp_path: Path) -> None:
    server = start_server(tiny_dir, tmp_path, "--max-num-seqs", "64", "--max-queue", "128")
    try:
        # A handful of distinct pictures (some requests share one) at a few sizes.
        conversations = [
            image_message(
                data_url(picture(seed=i % 11, size=(60 + 8 * (i % 5), 50 + 6 * (i % 3)))),
                f"Request {i}: what is shown?",
            )
            for i in range(CONCURRENT)
        ]

        async def run_all() -> list[str]:
            limits = httpx.Limits(max_connections=CONCURRENT)
            async with httpx.AsyncClient(timeout=300, limits=limits) as client:
                return await asyncio.gather(*(stream_one(client, server, c) for c in conversations))

        asyncio.run(run_all())  # warm-up: allocations settle
        api, engine = server.process.pid, server.engine_pid()
        before = rss_mib(api) + rss_mib(engine)
        texts = asyncio.run(run_all())
        after = rss_mib(api) + rss_mib(engine)

        llm = LLM(tiny_dir, dtype="float32", max_model_len=4096, kv_cache_memory_gib=0.05)
        alone = [
            llm.chat(c, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0].text for c in conversations
        ]
        print(f"\nAPI + engine RSS around {CONCURRENT} concurrent image streams: {before:.0f} MiB -> {after:.0f} MiB")
        assert texts == alone
        assert segments_left() == []
        assert after - before < 64, f"RSS grew from {before:.0f} MiB to {after:.0f} MiB"
        assert server.health() == 200
    finally:
        server.stop()
