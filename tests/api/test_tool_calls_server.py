"""Tool calls and reasoning through the real server, with the official openai client, on a tiny
Qwen2.5-VL checkpoint laid out as the published ones (the Qwen2.5 template with tools in
tokenizer_config.json). Its weights are random, so a call comes from the grammar: tool_choice
"required" and a named function force one; for "auto" a regex makes the model write
`...</think><tool_call>...</tool_call>`, which the reasoning parser and then the hermes parser
read back."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema_rs
import openai
import pytest
import transformers

from tests.api.conftest import Server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def tool_server(qwen25_tool_server: Server) -> Server:
    """The session's tiny Qwen2.5-VL with --enable-auto-tool-choice, --tool-call-parser hermes and
    --reasoning-parser qwen3 (tests/conftest.py)."""
    return qwen25_tool_server


@pytest.fixture(scope="module")
def client(tool_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key=tool_server.api_key, max_retries=0, timeout=120)


def streamed(client: openai.OpenAI, **request: object) -> tuple[dict, str | None]:
    """A streamed answer put together: content, reasoning, calls by index, finish_reason."""
    message: dict = {"content": "", "reasoning": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in client.chat.completions.create(model="tiny", stream=True, **request):  # type: ignore[call-overload]
        if chunk.usage is not None:
            message["usage"] = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            message["content"] += delta.content or ""
            for name in ("reasoning", "reasoning_content"):
                message[name] += (delta.model_extra or {}).get(name) or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in message["tool_calls"], "a call's id comes in its first delta only"
                    assert call.function and call.function.name and call.type == "function"
                    message["tool_calls"][call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
                message["tool_calls"][call.index]["arguments"] += call.function.arguments or ""  # type: ignore[union-attr]
            finish = choice.finish_reason or finish
    return message, finish


def calls_of(message: openai.types.chat.ChatCompletionMessage) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]  # type: ignore[union-attr]


def test_a_named_function_is_called_streamed_and_not(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    request = dict(messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, **GREEDY)
    whole = client.chat.completions.create(model="tiny", **request).choices[0]  # type: ignore[call-overload]
    assert whole.finish_reason == "stop"  # a named function's, as OpenAI's API and vLLM answer
    assert whole.message.content == ""  # vLLM's, not null
    [(name, arguments)] = calls_of(whole.message)
    assert name == "get_weather"
    assert json.loads(arguments)["city"] in ("Paris", "Oslo")  # the grammar forced the schema
    assert whole.message.tool_calls[0].id.startswith("call_")  # type: ignore[index]
    stream, finish = streamed(client, **request)
    assert finish == "stop"
    assert [(c["name"], c["arguments"]) for c in stream["tool_calls"].values()] == [(name, arguments)]
    assert stream["content"] == ""


def test_required_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    request = dict(messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    whole = client.chat.completions.create(model="tiny", **request, **GREEDY).choices[0]  # type: ignore[call-overload]
    assert whole.finish_reason == "tool_calls", whole
    [(name, arguments)] = calls_of(whole.message)
    assert name in ("get_weather", "get_time")
    assert isinstance(json.loads(arguments), dict)
    stream, _ = streamed(client, **request, **GREEDY)
    assert [(c["name"], c["arguments"]) for c in stream["tool_calls"].values()] == [(name, arguments)]


AUTO_REGEX = (
    r'I should look\.</think>\n\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}\n'
    r"</tool_call>"
)


def test_auto_reads_reasoning_then_calls_from_the_answer(client: openai.OpenAI) -> None:
    request = dict(
        messages=MESSAGES,
        tools=[WEATHER],
        extra_body={"structured_outputs": {"regex": AUTO_REGEX}},
        temperature=0,
        max_tokens=200,  # a random model may spell it out in short tokens
    )
    response = client.chat.completions.create(model="tiny", **request)  # type: ignore[call-overload]
    whole = response.choices[0]
    assert whole.finish_reason == "tool_calls"
    # vLLM's field is `reasoning` (its tests read message.reasoning); `reasoning_content` is kept.
    assert (whole.message.model_extra or {})["reasoning"] == "I should look."
    assert (whole.message.model_extra or {})["reasoning_content"] == "I should look."
    assert whole.message.content is None
    # The tokens before `</think>` (the reasoning parser's unit tests count them exactly).
    reasoning_tokens = response.usage.completion_tokens_details.reasoning_tokens  # type: ignore[union-attr]
    assert 0 < reasoning_tokens < response.usage.completion_tokens  # type: ignore[operator,union-attr]
    [(name, arguments)] = calls_of(whole.message)
    assert name == "get_weather"
    assert json.loads(arguments)["city"] in ("Paris", "Oslo")
    stream, finish = streamed(client, **request, stream_options={"include_usage": True})
    assert (stream["reasoning"], stream["reasoning_content"], finish) == ("I should look.",) * 2 + ("tool_calls",)
    assert stream["usage"].completion_tokens_details.reasoning_tokens == reasoning_tokens
    assert [(c["name"], c["arguments"]) for c in stream["tool_calls"].values()] == [(name, arguments)]
    # tool_choice "none": the same answer is content (the tools are still in the prompt, as vLLM).
    none = client.chat.completions.create(model="tiny", tool_choice="none", **request).choices[0]  # type: ignore[call-overload]
    assert none.finish_reason == "stop" and none.message.tool_calls is None
    assert none.message.content.startswith("\n\n<tool_call>\n")  # type: ignore[union-attr]
    # include_reasoning false drops the reasoning.
    request["extra_body"] |= {"include_reasoning": False}  # type: ignore[operator]
    quiet = client.chat.completions.create(model="tiny", **request).choices[0]  # type: ignore[call-overload]
    assert (quiet.message.model_extra or {}).get("reasoning_content") is None
    assert (quiet.message.model_extra or {}).get("reasoning") is None
    assert calls_of(quiet.message) == [(name, arguments)]


def test_a_tool_round_trip_renders_as_transformers_renders_it(
    client: openai.OpenAI, tool_server: Server, tiny25_dir: Path
) -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    reply = client.chat.completions.create(
        model="tiny", messages=history, tools=[WEATHER], tool_choice="none", max_tokens=2
    )  # type: ignore[arg-type]
    tokenized = tool_server.post("/tokenize", {"messages": history, "tools": [WEATHER]}).json()
    assert reply.usage.prompt_tokens == tokenized["count"]  # type: ignore[union-attr]
    # transformers' tokenizer renders the same history (arguments as the object they stand for).
    reference = transformers.AutoTokenizer.from_pretrained(str(tiny25_dir))
    history[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}  # type: ignore[index]
    history[1]["content"] = ""
    ids = reference.apply_chat_template(history, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in ids
    assert tokenized["tokens"] == reference(ids, add_special_tokens=False)["input_ids"]


# -- deep nesting: in the history, and in the answer ----------------------------------------------


def test_history_arguments_nested_too_deeply_get_400_naming_them(tool_server: Server) -> None:
    """A client sends a history whose tool call arguments (JSON text) nest 5,000 levels: the
    json module would recurse past the interpreter's limit (a 500). It is a 400 naming them."""
    engine = tool_server.engine_pid()
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "[" * 5000 + "]" * 5000}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}]
    history.append({"role": "tool", "tool_call_id": "c", "content": "sunny"})
    for path, body in (
        ("/v1/chat/completions", {"messages": history, "tools": [WEATHER], "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": history, "tools": [WEATHER], "max_tokens": 2, "stream": True}),
        ("/tokenize", {"messages": history, "tools": [WEATHER]}),
    ):
        response = tool_server.post(path, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["message"].startswith("messages[1].tool_calls[0].function.arguments is nested more than")
        assert error["param"] == "messages"
    assert tool_server.health() == 200 and tool_server.engine_pid() == engine


# `[[` and `]]` are single tokens of the Qwen vocabulary: favoured, the model writes the nesting
# in half as many tokens.
BRACKET_PAIRS = {"15505": 100, "5053": 100}


def test_a_call_nested_too_deeply_in_the_answer_is_content_streamed_and_not(tool_server: Server) -> None:
    """A regex makes the model write a call whose name nests 1,000 levels (past the json module's
    recursion): whole, it was a 500; streamed, a stream cut without an error or [DONE]. Now the
    block is not a call: the answer is its plain content, both ways, and the stream ends."""
    engine = tool_server.engine_pid()
    n = 1000
    answer = '<tool_call>{"name": ' + "[" * n + "]" * n + ', "arguments": {}}</tool_call>'
    body = {
        "messages": MESSAGES,
        "tools": [WEATHER],
        "structured_outputs": {"regex": r"ok</think>" + re.escape(answer)},
        "logit_bias": BRACKET_PAIRS,
        "temperature": 0,
        "max_tokens": 2 * n,
    }
    response = tool_server.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice["message"]["content"] == answer and choice["message"].get("tool_calls") is None
    assert choice["finish_reason"] == "stop"
    with httpx.stream(
        "POST",
        tool_server.url + "/v1/chat/completions",
        json=body | {"stream": True},
        headers=tool_server.headers,
        timeout=120,
    ) as stream:
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == answer
    assert not any(d.get("tool_calls") for d in deltas)
    assert tool_server.health() == 200 and tool_server.engine_pid() == engine


# -- what vLLM's own tests ask of tools (tests/entrypoints/openai/test_completion_with_function_calling.py) --


def _tool_with_defs(name: str, options: dict) -> dict:
    """Parameters as pydantic writes them: a $ref into their own $defs. Both tools below name
    their definition "Options", each a different one."""
    options = options | {"type": "object", "required": list(options["properties"]), "additionalProperties": False}
    parameters = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "options": {"$ref": "#/$defs/Options"}},
        "required": ["city", "options"],
        "additionalProperties": False,
        "$defs": {"Options": options},
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


DEFS_TOOLS = [
    _tool_with_defs("get_current_weather", {"properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}}),
    _tool_with_defs("get_forecast", {"properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}}}),
]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_current_weather"}}], ids=str
)
def test_tools_whose_parameters_use_defs_are_called_streamed_and_not(
    client: openai.OpenAI, tool_choice: object
) -> None:
    """tool_choice "required" was a 400 ("Cannot find field '$defs'"): the array schema held each
    tool's parameters without their definitions. Each call's arguments follow its own tool's."""
    request = dict(messages=MESSAGES, tools=DEFS_TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    request |= {"temperature": 0, "max_tokens": 200}  # a random model may spell the call in short tokens
    whole = client.chat.completions.create(model="tiny", **request).choices[0]  # type: ignore[call-overload]
    assert whole.finish_reason in ("stop", "tool_calls"), whole
    [(name, arguments)] = calls_of(whole.message)
    tool = next(t for t in DEFS_TOOLS if t["function"]["name"] == name)
    assert jsonschema_rs.validator_for(tool["function"]["parameters"]).is_valid(json.loads(arguments)), arguments
    assert whole.message.content == ""
    stream, _ = streamed(client, **request)
    assert [(c["name"], c["arguments"]) for c in stream["tool_calls"].values()] == [(name, arguments)]


def test_a_streamed_request_whose_grammar_does_not_compile_gets_a_400_not_an_error_event(tool_server: Server) -> None:
    """The engine refuses a grammar that does not compile; a stream waits for it to take the
    request before it starts, so the client gets the same 400 as without stream."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}
    body = {
        "messages": MESSAGES,
        "max_tokens": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    completion = {"prompt": ["One", "Two"], "max_tokens": 5, "structured_outputs": {"json": schema}}
    for path, request in (("/v1/chat/completions", body), ("/v1/completions", completion)):
        for stream in (False, True):
            response = tool_server.post(path, request | {"stream": stream})
            assert response.status_code == 400, (path, response.text)
            assert response.headers["content-type"].startswith("application/json")
            assert "JSON schema could not be compiled" in response.json()["error"]["message"]
    # A stream whose grammar compiles still streams.
    fine = body | {"response_format": {"type": "json_object"}, "stream": True}
    with httpx.stream(
        "POST", tool_server.url + "/v1/chat/completions", json=fine, headers=tool_server.headers, timeout=120
    ) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    fine = completion | {"structured_outputs": {"json_object": True}, "stream": True}
    with httpx.stream(
        "POST", tool_server.url + "/v1/completions", json=fine, headers=tool_server.headers, timeout=120
    ) as response:
        assert response.status_code == 200
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1}  # both prompts streamed
    assert not any("error" in c for c in chunks)
    assert tool_server.health() == 200


def test_a_call_cut_short_by_max_tokens_is_not_a_call(tool_server: Server) -> None:
    """max_tokens too small to finish the named call's arguments: no `{"` as a tool call."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": choice, "temperature": 0, "max_tokens": 2}
    [answer] = tool_server.post("/v1/chat/completions", body).json()["choices"]
    assert answer["finish_reason"] == "length"
    assert answer["message"].get("tool_calls") is None
    assert answer["message"]["content"].startswith("{")


def test_token_ids_and_logprobs_fields_with_tools(tool_server: Server, tiny25_dir: Path) -> None:
    """return_token_ids with a forced call: the call's tokens; return_tokens_as_token_ids in chat
    logprobs; prompt_logprobs present (null) where not asked for, as vLLM's responses hold it."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = {
        "messages": MESSAGES,
        "tools": [WEATHER],
        "tool_choice": choice,
        "return_token_ids": True,
        "logprobs": True,
        "return_tokens_as_token_ids": True,
        **GREEDY,
    }
    response = tool_server.post("/v1/chat/completions", body).json()
    [answer] = response["choices"]
    [call] = answer["message"]["tool_calls"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny25_dir))
    assert tokenizer.decode(answer["token_ids"], skip_special_tokens=True) == call["function"]["arguments"]
    assert tokenizer.decode(response["prompt_token_ids"]).endswith("<|im_start|>assistant\n")
    assert [e["token"] for e in answer["logprobs"]["content"]] == [f"token:{t}" for t in answer["token_ids"]]
    assert "prompt_logprobs" in response and response["prompt_logprobs"] is None
    completion = tool_server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).json()
    assert "prompt_logprobs" in completion["choices"][0] and completion["choices"][0]["prompt_logprobs"] is None
