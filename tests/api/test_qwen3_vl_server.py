"""Qwen3-VL through the real server: the official openai client gets the offline API's tokens
(and top logprobs) for a video request (the video's timestamped spans and DeepStack features
cross the process boundary as the offline engine has them). An image request, for every family,
is the families' conformance suite's (tests/families)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.api.conftest import Server
from tests.api.test_video_server import (
    ask,
    assert_same_answer,
    offline_answer,
    served,
    video_message,
    video_url,
)
from tests.conftest import write_video
from vlmserve import LLM


@pytest.fixture(scope="module")
def client(qwen3_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen3_server.url + "/v1", api_key=qwen3_server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny3_dir: Path) -> LLM:
    return LLM(
        tiny3_dir, dtype="float32", max_model_len=4096, kv_cache_memory_gib=0.05, limit_mm_per_prompt={"image": 3}
    )


def test_a_video_request_is_answered_as_offline(client: openai.OpenAI, offline: LLM) -> None:
    messages = video_message(video_url(write_video(20, fps=8, width=64, height=48)))
    reply = ask(client, messages, 6)
    assert_same_answer(served(reply), offline_answer(offline, messages, 6)[0])
    # One usage entry per timestamped span of the video: 5 frames padded to 3 temporal patches.
    spans = (reply.usage.model_extra or {})["multimodal_tokens"]
    assert [item["modality"] for item in spans] == ["video"] * 3
