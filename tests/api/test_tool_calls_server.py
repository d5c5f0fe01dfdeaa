"""Tool calls and reasoning through the real server, with the official openai client, on a tiny
Qwen2.5-VL checkpoint laid out as the published ones (the Qwen2.5 template with tools in
tokenizer_config.json). Its weights are random, so a call comes from the grammar: tool_choice
"required" and a named function force one; for "auto" a regex makes the model write
`...</think><tool_call>...</tool_call>`, which the reasoning parser and then the hermes parser
read back."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import transformers

from tests.api.conftest import Server, start_server

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
def tool_server(tiny25_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    extra = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    s = start_server(tiny25_dir, tmp_path_factory.mktemp("tool-server"), *extra)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(tool_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tool_server.url + "/v1", api_key=tool_server.api_key, max_retries=0, timeout=120)


def streamed(client: openai.OpenAI, **request: object) -> tuple[dict, str | None]:
    """A streamed answer put together: content, reasoning, calls by index, finish_reason."""
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in client.chat.completions.create(model="tiny", stream=True, **request):  # type: ignore[call-overload]
        for choice in chunk.choices:
            delta = choice.delta
            message["content"] += delta.content or ""
            message["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
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
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content is None
    [(name, arguments)] = calls_of(whole.message)
    assert name == "get_weather"
    assert json.loads(arguments)["city"] in ("Paris", "Oslo")  # the grammar forced the schema
    assert whole.message.tool_calls[0].id.startswith("call_")  # type: ignore[index]
    stream, finish = streamed(client, **request)
    assert finish == "tool_calls"
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
    whole = client.chat.completions.create(model="tiny", **request).choices[0]  # type: ignore[call-overload]
    assert whole.finish_reason == "tool_calls"
    assert (whole.message.model_extra or {})["reasoning_content"] == "I should look."
    assert whole.message.content is None
    [(name, arguments)] = calls_of(whole.message)
    assert name == "get_weather"
    assert json.loads(arguments)["city"] in ("Paris", "Oslo")
    stream, finish = streamed(client, **request)
    assert (stream["reasoning_content"], finish) == ("I should look.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in stream["tool_calls"].values()] == [(name, arguments)]
    # tool_choice "none": the same answer is content (the tools are still in the prompt, as vLLM).
    none = client.chat.completions.create(model="tiny", tool_choice="none", **request).choices[0]  # type: ignore[call-overload]
    assert none.finish_reason == "stop" and none.message.tool_calls is None
    assert none.message.content.startswith("\n\n<tool_call>\n")  # type: ignore[union-attr]
    # include_reasoning false drops the reasoning.
    request["extra_body"] |= {"include_reasoning": False}  # type: ignore[operator]
    quiet = client.chat.completions.create(model="tiny", **request).choices[0]  # type: ignore[call-overload]
    assert (quiet.message.model_extra or {}).get("reasoning_content") is None
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
