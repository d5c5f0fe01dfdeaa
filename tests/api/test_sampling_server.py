"""The sampling fields of the OpenAI-compatible API (vLLM's extensions and OpenAI's penalties)
reach the engine: the server's answers equal the offline engine's with the same SamplingParams;
out-of-range values are 400s naming the field; a streamed completion ends with usage when
stream_options.include_usage asks."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.conftest import Server
from vlmserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_dir: Path) -> LLM:
    return LLM(tiny_dir, dtype="float32", max_model_len=4096, kv_cache_memory_gib=0.02)


PROMPT = "Once upon a time, in a lighthouse by the sea,"
FIELDS = {
    "repetition_penalty": 1.3,
    "presence_penalty": 0.7,
    "frequency_penalty": 0.4,
    "min_tokens": 3,
    "logit_bias": {"11": -5.0, "13": 2.5},
    "bad_words": ["the"],
}


def test_sampling_fields_reach_the_engine(client: openai.OpenAI, offline: LLM) -> None:
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body=FIELDS, logprobs=0
    )
    params = SamplingParams(
        temperature=0,
        max_tokens=12,
        **{**FIELDS, "logit_bias": {int(k): v for k, v in FIELDS["logit_bias"].items()}},  # type: ignore[arg-type]
    )
    expected = offline.generate(PROMPT, params)[0].outputs[0]
    assert reply.choices[0].text == expected.text
    plain = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert plain.text != expected.text  # the fields change the answer


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("min_p", 1.5),
        ("min_tokens", 20),  # more than max_tokens
        ("logit_bias", {"abc": 1.0}),
        ("logit_bias", {"999999999": 1.0}),  # past the vocabulary
        ("bad_words", [" "]),
    ],
)
def test_out_of_range_sampling_fields_are_400s_naming_the_field(server: Server, field: str, value: object) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, field: value}
    response = server.post("/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field or field in error["message"], error
    assert server.health() == 200


def test_streamed_completions_end_with_usage_when_asked(server: Server) -> None:
    body = {
        "model": "tiny",
        "prompt": [PROMPT, "Hello"],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=120
    ) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and all("usage" not in c for c in chunks[:-1])
    assert usage["completion_tokens"] == 10 and usage["total_tokens"] == usage["prompt_tokens"] + 10
    plain = server.post("/v1/completions", {**body, "stream": False, "stream_options": None}).json()["usage"]
    assert usage == {k: plain[k] for k in usage}
