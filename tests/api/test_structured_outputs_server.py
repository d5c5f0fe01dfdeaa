"""Structured outputs through the server with the official openai client: response_format
(json_schema, json_object), vLLM's structured_outputs and guided_* fields, on chat and
completions, streamed and not; a malformed or doubled request is a 400 naming the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema_rs
import openai
import pytest

from tests.api.conftest import Server

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["color", "count", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def test_chat_response_format_json_schema(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Describe a thing."}]
    reply = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny",
        messages=messages,
        max_tokens=150,
        temperature=1.0,
        seed=3,
        response_format=response_format,
    )
    text = reply.choices[0].message.content or ""
    assert reply.choices[0].finish_reason == "stop", text
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(text)), text
    stream = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny",
        messages=messages,
        max_tokens=150,
        temperature=1.0,
        seed=3,
        response_format=response_format,
        stream=True,
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == text


def test_json_object_and_vllm_fields(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_object"},
        extra_body={"structured_outputs": None},
    )
    assert (reply.choices[0].message.content or "").startswith("{")
    choices = ["cat", "dog", "sea lion"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        out = client.completions.create(
            model="tiny", prompt="Pick:", max_tokens=10, temperature=1.0, n=3, seed=1, extra_body=extra
        )
        assert all(c.text in choices for c in out.choices), [c.text for c in out.choices]
    pattern = r"[A-Z][a-z]{1,3} [0-9]{2}"
    out = client.completions.create(
        model="tiny", prompt="Name:", max_tokens=12, temperature=1.0, extra_body={"guided_regex": pattern}
    )
    assert re.fullmatch(pattern, out.choices[0].text), out.choices[0].text


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, None, "regex could not be compiled"),
        ({"guided_json": "{nope"}, None, "JSON schema could not be compiled"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
        ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "one structured output"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ],
)
def test_bad_structured_outputs_are_400s(client: openai.OpenAI, extra: dict, param: str | None, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
    assert words in info.value.message
    if param is not None:
        assert info.value.body["param"] == param  # type: ignore[index]
    # The server goes on.
    ok = client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"guided_choice": ["fine"]})
    assert ok.choices[0].text == "fine"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guided_regex", "a\ud800"),  # a lone surrogate cannot be encoded for the engine
        ("guided_choice", ["ok", "\ud800"]),
        ("guided_json", {"type": "string", "enum": ["\ud800"]}),
    ],
)
def test_text_the_engine_cannot_take_is_refused(server: Server, field: str, value: object) -> None:
    from tests.api.test_fuzz import _encoded

    body = {"model": "tiny", "max_tokens": 2, "prompt": "hi", field: value}
    headers = {**server.headers, "content-type": "application/json"}
    response = httpx.post(server.url + "/v1/completions", content=_encoded(body), headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
