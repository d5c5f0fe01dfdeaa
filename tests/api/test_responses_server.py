"""POST /v1/responses through the real server with the official openai client: a response runs as
the chat request its conversation makes (the same prompt, so the same greedy answer), with an
image, text.format json_schema, function tools forced by tool_choice (a random model's calls come
from the grammar), previous_response_id over the bounded store, GET and DELETE, streamed as the
typed events the client puts together; and the same admission, API key and body checks as chat.

`server` (tests/conftest.py) is the tiny Qwen2-VL (its template takes no tools); `tool_server`
is the session's tiny Qwen2.5-VL, whose template takes tools, with --reasoning-parser qwen3 and a
store of two responses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import openai
import pytest

from tests.api.conftest import Server, data_url, picture

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
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER_PARAMETERS}
JSON_OBJECT = {"format": {"type": "json_object"}}
CHAT_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER_PARAMETERS},
}


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tool_server(qwen25_tool_server: Server) -> Server:
    """The session's tiny Qwen2.5-VL with --reasoning-parser qwen3 and --responses-store-max-entries 2
    (tests/conftest.py; it has the tool calls' flags too, which no request here with tools asks for:
    each names its tool_choice)."""
    return qwen25_tool_server


@pytest.fixture(scope="module")
def tool_client(tool_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key=tool_server.api_key, max_retries=0, timeout=120)


def raw_events(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed response's events as sent: `event:` and the data's type agree."""
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=server.headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: ") :])
                assert event["type"] == name
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_an_image_request_runs_as_the_chat_request(client: openai.OpenAI, server: Server) -> None:
    """instructions + input_text + input_image (detail low, 1024x1024): the chat prompt and the
    chat endpoint's greedy answer; the image takes the low budget's 256 tokens."""
    image = data_url(picture(5, (1024, 1024)))
    request: dict[str, Any] = {
        "model": "tiny",
        "instructions": "Answer in one word.",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": image, "detail": "low"},
                    {"type": "input_text", "text": "What is this?"},
                ],
            }
        ],
        "max_output_tokens": 5,
        "temperature": 0,
        "store": False,
    }
    response = client.responses.create(**request)
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image, "detail": "low"}},
                {"type": "text", "text": "What is this?"},
            ],
        },
    ]
    chat = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 5, "temperature": 0}).json()
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage is not None
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert response.usage.model_extra["multimodal_tokens"][0]["tokens"] == 256  # type: ignore[index]
    cut = chat["choices"][0]["finish_reason"] == "length"
    assert response.status == ("incomplete" if cut else "completed")
    assert (response.incomplete_details is not None) == cut
    assert response.temperature == 0 and response.instructions == "Answer in one word."
    # Streamed: the same answer, its last event the response as a whole.
    with client.responses.stream(**request) as stream:
        events = list(stream)
    last = events[-1]
    assert last.type == ("response.incomplete" if cut else "response.completed")
    assert last.response.output_text == response.output_text  # type: ignore[union-attr]
    streamed_text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed_text == response.output_text
    assert last.response.usage.model_extra["multimodal_tokens"] == response.usage.model_extra["multimodal_tokens"]  # type: ignore[union-attr]
    # store false: not kept
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_json_schema_format_streamed_and_not(client: openai.OpenAI, server: Server) -> None:
    text = {"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}}
    request: dict[str, Any] = {
        "model": "tiny",
        "input": "Describe a thing.",
        "max_output_tokens": 150,
        "temperature": 1.0,
        "text": text,
        "extra_body": {"seed": 3},
    }
    response = client.responses.create(**request)
    assert response.status == "completed", response.output_text
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(response.output_text))
    # The chat endpoint's answer to the same conversation and sampling.
    chat_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    chat = server.post(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Describe a thing."}],
            "max_tokens": 150,
            "temperature": 1.0,
            "seed": 3,
            "response_format": chat_format,
        },
    ).json()
    assert response.output_text == chat["choices"][0]["message"]["content"]

    with client.responses.stream(**request) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == response.output_text
    assert final.status == "completed" and final.id != response.id
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(server: Server) -> None:
    events = raw_events(server, {"input": "Hello", "max_output_tokens": 3, "temperature": 0, "stream": True})
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["usage"]["output_tokens"] == 3
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    (done,) = [e for e in events if e["type"] == "response.output_item.done"]
    assert done["item"]["status"] == "incomplete" and done["item"]["content"][0]["text"] == text
    assert last["response"]["output"] == [done["item"]]


def test_a_streamed_format_that_does_not_compile_is_a_400_not_an_error_event(server: Server) -> None:
    """The engine refuses a grammar that does not compile; a stream waits for it to take the
    request before it starts, so the client gets the same 400 as without stream."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}
    body = {"model": "tiny", "input": "Hello", "max_output_tokens": 3}
    body["text"] = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    pid = server.engine_pid()
    for stream in (False, True):
        response = server.post("/v1/responses", body | {"stream": stream})
        assert response.status_code == 400, response.text
        assert response.headers["content-type"].startswith("application/json")
        assert "JSON schema could not be compiled" in response.json()["error"]["message"]
    assert server.health() == 200 and server.engine_pid() == pid


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI, server: Server) -> None:
    """The second turn's prompt is the whole conversation rendered at once: the chat endpoint's
    prompt for the same messages, and so its greedy answer."""
    first = client.responses.create(model="tiny", input="Hello there", max_output_tokens=4, temperature=0)
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input="And then?",
        max_output_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    messages = [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    chat = server.post(
        "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    ).json()
    tokenized = server.post("/tokenize", {"messages": messages}).json()
    assert tokenized["tokens"] == chat["prompt_token_ids"]
    assert second.usage is not None and second.usage.input_tokens == tokenized["count"]
    assert (second.model_extra or {})["prompt_token_ids"] == tokenized["tokens"]  # token for token
    assert (second.model_extra or {})["output_token_ids"] == chat["choices"][0]["token_ids"]
    assert second.output_text == chat["choices"][0]["message"]["content"]
    assert second.previous_response_id == first.id
    # Kept (store defaults to true): GET gives it back as it was sent.
    again = client.responses.retrieve(first.id)
    assert (again.id, again.output_text, again.usage) == (first.id, first.output_text, first.usage)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_unset_sampling_fields_are_the_checkpoints_defaults(server: Server, tiny_dir: Path) -> None:
    defaults = json.loads((tiny_dir / "generation_config.json").read_text())
    r = server.post("/v1/responses", {"input": "hi", "max_output_tokens": 1, "store": False}).json()
    assert (r["temperature"], r["top_p"]) == (defaults["temperature"], defaults["top_p"])
    r = server.post("/v1/responses", {"input": "hi", "max_output_tokens": 1, "store": False, "top_p": 0.5}).json()
    assert (r["temperature"], r["top_p"]) == (defaults["temperature"], 0.5)


def test_an_unknown_previous_response_id_is_a_404_naming_it(server: Server) -> None:
    r = server.post("/v1/responses", {"input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["param"] == "previous_response_id"
    assert "resp_nope" in error["message"] and "not found" in error["message"]
    assert server.get("/v1/responses/resp_nope").status_code == 404


def test_a_named_function_is_called_streamed_and_not_then_answered(
    tool_client: openai.OpenAI, tool_server: Server
) -> None:
    request: dict[str, Any] = {
        "model": "tiny",
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 40,
        "temperature": 0,
    }
    response = tool_client.responses.create(**request)
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    with tool_client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (streamed,) = final.output
    assert streamed.type == "function_call" and streamed.arguments == call.arguments
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments
    # The tool's answer, continuing the stored response: the chat endpoint's prompt for the
    # same turns (the call in the assistant's tool_calls, the output as a tool message).
    answer = tool_client.responses.create(
        model="tiny",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=4,
        temperature=0,
    )
    function = {"name": "get_weather", "arguments": call.arguments}
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": call.call_id, "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
    ]
    chat = tool_server.post(
        "/v1/chat/completions",
        {"messages": messages, "tools": [CHAT_WEATHER], "tool_choice": "none", "max_tokens": 4, "temperature": 0},
    ).json()
    assert answer.usage is not None and answer.usage.input_tokens == chat["usage"]["prompt_tokens"]
    # The reasoning parser reads the same greedy answer alike (a random model never closes its
    # reasoning: all of it is reasoning).
    chat_message = chat["choices"][0]["message"]
    reasoning = [item.content[0].text for item in answer.output if item.type == "reasoning" and item.content]
    assert reasoning == ([chat_message["reasoning_content"]] if chat_message["reasoning_content"] else [])
    assert answer.output_text == (chat_message["content"] or "")


def test_required_tool_choice_calls_a_tool(tool_client: openai.OpenAI) -> None:
    time_tool = {"type": "function", "name": "get_time"}
    response = tool_client.responses.create(
        model="tiny",
        input="Weather or time?",
        tools=[WEATHER, time_tool],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
        store=False,
    )
    assert response.output and all(item.type == "function_call" for item in response.output)
    assert len(response.output) == 1
    assert response.output[0].name in ("get_weather", "get_time")  # type: ignore[union-attr]


def test_reasoning_is_an_item_of_its_own_streamed_and_not(tool_client: openai.OpenAI, tool_server: Server) -> None:
    """--reasoning-parser qwen3: an answer forced to `Let me see</think>Paris` is a reasoning
    item, then a message; reasoning_tokens counts the tokens up to and with `</think>`."""
    request: dict[str, Any] = {
        "model": "tiny",
        "input": "Capital of France?",
        "max_output_tokens": 30,
        "temperature": 0,
        "store": False,
        "extra_body": {"structured_outputs": {"regex": "Let me see</think>Paris"}},
    }
    response = tool_client.responses.create(**request)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert reasoning.content is not None and reasoning.content[0].text == "Let me see"
    assert response.output_text == "Paris"
    # The same answer's tokens from the chat endpoint: the first reasoning_tokens of them end
    # with `</think>` (a grammar may write it in several tokens).
    chat = tool_server.post(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Capital of France?"}],
            "max_tokens": 30,
            "temperature": 0,
            "structured_outputs": {"regex": "Let me see</think>Paris"},
            "return_token_ids": True,
        },
    ).json()
    token_ids = chat["choices"][0]["token_ids"]
    assert response.usage is not None and response.usage.output_tokens == len(token_ids)
    thinking = response.usage.output_tokens_details.reasoning_tokens
    text = tool_server.post("/detokenize", {"tokens": token_ids[:thinking]}).json()["prompt"]
    shorter = tool_server.post("/detokenize", {"tokens": token_ids[: thinking - 1]}).json()["prompt"]
    assert text == "Let me see</think>" and "</think>" not in shorter
    with tool_client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    reasoning_deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning_deltas == "Let me see"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == "Paris"


def test_the_store_keeps_the_most_recent_and_names_an_evicted_id(tool_server: Server) -> None:
    """--responses-store-max-entries 2: a third response evicts the first."""
    ids = []
    for text in ("one", "two", "three"):
        r = tool_server.post("/v1/responses", {"input": text, "max_output_tokens": 1})
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    assert tool_server.get(f"/v1/responses/{ids[2]}").json()["id"] == ids[2]
    assert tool_server.get(f"/v1/responses/{ids[1]}").status_code == 200
    gone = tool_server.post("/v1/responses", {"input": "four", "previous_response_id": ids[0]})
    assert gone.status_code == 404
    assert "evicted" in gone.json()["error"]["message"] and "2 most recent" in gone.json()["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
            "input",
            "file_id",
        ),
        ({"input": [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "x"}]}, "input", "input[1]"),
        ({"input": [{"role": "critic", "content": "hi"}]}, "input", "input[0].role"),
        ({"input": [{"role": ["user"], "content": "hi"}]}, "input", "input[0].role"),
        ({"input": ["hi"]}, "input", "input[0] must be an object"),
        ({"input": [{"role": "user", "content": [["x"]]}]}, "input", "input[0].content[0]: unknown part type"),
        ({"input": [{"type": {"a": 1}}]}, "input", "input[0]: item type"),
        ({"tools": [{"type": "function", "name": ["f"]}]}, "tools[0]", "tools[0].name"),
        ({"background": True}, "background", "background"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "schema"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"max_output_tokens": 100_000}, "max_output_tokens", "max_output_tokens must be at most 4095"),
        (
            {
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": "required",
                "text": {"format": {"type": "json_object"}},
            },
            "tool_choice",
            "cannot be combined with structured outputs",
        ),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server: Server, extra: dict, param: str, words: str) -> None:
    r = server.post("/v1/responses", {"input": "hi", "max_output_tokens": 1} | extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_the_routes_have_the_chat_endpoints_guards(server: Server) -> None:
    body = {"input": "hi", "max_output_tokens": 1}
    assert httpx.post(server.url + "/v1/responses", json=body).status_code == 401
    assert httpx.get(server.url + "/v1/responses/resp_x").status_code == 401
    plain = server.post("/v1/responses", content=json.dumps(body), headers={"Content-Type": "text/plain"})
    assert plain.status_code == 415
    assert server.get("/health").status_code == 200
