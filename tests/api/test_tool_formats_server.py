"""Tool calls in both of the Qwen formats through the real server, with the official openai
client: hermes (JSON in `<tool_call>` blocks) on a tiny Qwen3-VL checkpoint with its published
template, and Qwen3.5's XML format (`--tool-call-parser qwen3_coder`) on a tiny Qwen3.5 checkpoint
with its published template, which thinks by default (its generation prompt opens `<think>`).
Both servers run `--reasoning-parser qwen3`. The weights are random, so a call comes from a
grammar: tool_choice "required" and a named function force one in the server's format; for
"auto" a regex makes the model write reasoning and a call, which the parsers read back. A tool
round trip renders token for token as transformers renders it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import transformers

from tests.api.conftest import Server, start_server
from tests.api.test_tool_calls_server import calls_of, streamed

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "max_tokens": 120}
FLAGS = ("--enable-auto-tool-choice", "--reasoning-parser", "qwen3", "--tool-call-parser")


@pytest.fixture(scope="module")
def servers(tiny3_dir: Path, tiny35_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    tmp = tmp_path_factory.mktemp("tool-format-servers")
    started = {
        "hermes": start_server(tiny3_dir, tmp, *FLAGS, "hermes"),
        "qwen3_coder": start_server(tiny35_dir, tmp, *FLAGS, "qwen3_coder"),
    }
    yield started
    for s in started.values():
        s.stop()


@pytest.fixture(scope="module")
def dirs(tiny3_dir: Path, tiny35_dir: Path) -> dict[str, Path]:
    return {"hermes": tiny3_dir, "qwen3_coder": tiny35_dir}


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


def reference_tokenizer(model_dir: Path) -> transformers.PreTrainedTokenizerBase:
    """transformers' tokenizer of the checkpoint with its chat template (Qwen3-VL's is in
    chat_template.json, the processor's file, which the tokenizer alone does not read)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.chat_template is None:
        tokenizer.chat_template = json.loads((model_dir / "chat_template.json").read_text())["chat_template"]
    return tokenizer


def answer_text(model_dir: Path, token_ids: list[int]) -> str:
    return reference_tokenizer(model_dir).decode(token_ids, skip_special_tokens=True)


FORMATS = ["hermes", "qwen3_coder"]
# On the qwen3_coder server a thinking answer reasons before a forced call (as vLLM): `</think>`
# favoured, the random model ends its reasoning at once (the grammar then allows it nowhere else
# these tools' values could take it).
CLOSE_THINKING = {"logit_bias": {"151668": 100}}
# How each format writes the start of a call to get_weather.
CALL_START = {"hermes": '<tool_call>\n{"name": "get_weather"', "qwen3_coder": "<tool_call>\n<function=get_weather>\n"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_named_function_is_called_in_the_server_s_format(
    fmt: str, servers: dict[str, Server], dirs: dict[str, Path]
) -> None:
    client = client_of(servers[fmt])
    choice = {"type": "function", "function": {"name": "get_weather"}}
    request = dict(messages=MESSAGES, tools=[WEATHER, TIME], tool_choice=choice, **GREEDY)
    extra = {"return_token_ids": True} | CLOSE_THINKING
    whole = client.chat.completions.create(model="tiny", extra_body=extra, **request).choices[0]  # type: ignore[call-overload]
    assert whole.finish_reason == "stop", whole  # a named function's, as OpenAI's and vLLM's
    [(name, arguments)] = calls_of(whole.message)
    assert name == "get_weather"
    assert json.loads(arguments)["city"] in ("Paris", "Oslo")
    assert isinstance(json.loads(arguments)["celsius"], bool)  # typed by the schema in both formats
    assert whole.message.content == ""  # a forced call's, as vLLM's
    text = answer_text(dirs[fmt], (whole.model_extra or {})["token_ids"])
    reasoning = (whole.message.model_extra or {}).get("reasoning_content")
    if fmt == "qwen3_coder":  # thinking on (Qwen3.5's default): reasoning, then the call as the template writes it
        assert reasoning == "" and text.startswith("</think>\n\n" + CALL_START[fmt]), text
        assert re.search(r"<parameter=celsius>\n(true|false)\n</parameter>\n</function>\n</tool_call>", text), text
    else:  # vLLM's: the function's parameters as JSON, from the first token
        assert reasoning is None and json.loads(text) == json.loads(arguments)
    stream, finish = streamed(client, extra_body=CLOSE_THINKING, **request)
    assert finish == "stop"
    assert [(c["name"], c["arguments"]) for c in stream["tool_calls"].values()] == [(name, arguments)]
    assert stream["reasoning_content"] == ""


@pytest.mark.parametrize("fmt", FORMATS)
def test_required_calls_one_of_the_tools(fmt: str, servers: dict[str, Server], dirs: dict[str, Path]) -> None:
    client = client_of(servers[fmt])
    request = dict(messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False) | {
        "extra_body": CLOSE_THINKING
    }
    whole = client.chat.completions.create(model="tiny", **request, **GREEDY).choices[0]  # type: ignore[call-overload]
    assert whole.finish_reason == "tool_calls", whole
    [(name, arguments)] = calls_of(whole.message)
    assert name in ("get_weather", "get_time")
    assert isinstance(json.loads(arguments), dict)
    stream, _ = streamed(client, **request, **GREEDY)
    assert [(c["name"], c["arguments"]) for c in stream["tool_calls"].values()] == [(name, arguments)]
    # Thinking off changes the prompt, not the call's format.
    request["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True}
    off = client.chat.completions.create(model="tiny", **request, **GREEDY).choices[0]  # type: ignore[call-overload]
    assert off.finish_reason == "tool_calls" and len(calls_of(off.message)) == 1
    assert (off.message.model_extra or {}).get("reasoning_content") is None
    if fmt == "qwen3_coder":  # the template closed the reasoning: the call from the first token
        assert answer_text(dirs[fmt], (off.model_extra or {})["token_ids"]).startswith("<tool_call>\n<function=")


# The call each format writes, for a regex (the city left to the model).
AUTO_CALL = {
    "hermes": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", "celsius": true\}\}\n'
    r"</tool_call>",
    "qwen3_coder": r"<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Oslo)\n</parameter>\n"
    r"<parameter=celsius>\ntrue\n</parameter>\n</function>\n</tool_call>",
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("lead", "reasoning"),
    [
        (r"I should look\.\n</think>\n\n", "I should look.\n"),  # a call right after the reasoning
        (r"I should look\.\n", "I should look.\n"),  # a call inside it
    ],
)
def test_auto_reads_a_call_inside_or_after_the_reasoning(
    fmt: str, lead: str, reasoning: str, servers: dict[str, Server]
) -> None:
    client = client_of(servers[fmt])
    request = dict(
        messages=MESSAGES,
        tools=[WEATHER],
        extra_body={"structured_outputs": {"regex": lead + AUTO_CALL[fmt]}},
        temperature=0,
        max_tokens=300,  # a random model may spell it out in short tokens
    )
    whole = client.chat.completions.create(model="tiny", **request).choices[0]  # type: ignore[call-overload]
    assert whole.finish_reason == "tool_calls", whole
    assert (whole.message.model_extra or {})["reasoning_content"] == reasoning
    assert whole.message.content is None
    [(name, arguments)] = calls_of(whole.message)
    assert name == "get_weather"
    assert json.loads(arguments)["celsius"] is True and json.loads(arguments)["city"] in ("Paris", "Oslo")
    stream, finish = streamed(client, **request)
    assert (stream["reasoning_content"], finish) == (reasoning, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in stream["tool_calls"].values()] == [(name, arguments)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_auto_with_thinking_off_reads_content_and_a_call(fmt: str, servers: dict[str, Server]) -> None:
    client = client_of(servers[fmt])
    extra = {"structured_outputs": {"regex": r"Sure\.\n\n" + AUTO_CALL[fmt]}}
    extra["chat_template_kwargs"] = {"enable_thinking": False}
    request = dict(messages=MESSAGES, tools=[WEATHER], extra_body=extra, temperature=0, max_tokens=300)
    whole = client.chat.completions.create(model="tiny", **request).choices[0]  # type: ignore[call-overload]
    assert (whole.finish_reason, whole.message.content) == ("tool_calls", "Sure.\n\n")
    assert (whole.message.model_extra or {}).get("reasoning_content") is None
    assert [name for name, _ in calls_of(whole.message)] == ["get_weather"]
    stream, _ = streamed(client, **request)
    assert (stream["content"], stream["reasoning_content"]) == ("Sure.\n\n", "")
    assert [(c["name"], c["arguments"]) for c in stream["tool_calls"].values()] == calls_of(whole.message)


ROUND_TRIP = [
    *MESSAGES,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "celsius": true}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny in Paris."},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "kwargs",
    # Thinking on (the template's default), off, and a budget hint (Qwen3.5's template has none: it
    # renders as without, as transformers renders it).
    [{}, {"enable_thinking": False}, {"thinking_budget": 16}],
)
def test_a_tool_round_trip_renders_as_transformers_renders_it(
    fmt: str, kwargs: dict, servers: dict[str, Server], dirs: dict[str, Path]
) -> None:
    server = servers[fmt]
    thinking = kwargs.get("enable_thinking")
    body = {"messages": ROUND_TRIP, "tools": [WEATHER], "chat_template_kwargs": kwargs}
    tokenized = server.post("/tokenize", body).json()
    reply = client_of(server).chat.completions.create(
        model="tiny",
        messages=ROUND_TRIP,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_tokens=1,
        extra_body={"chat_template_kwargs": kwargs},
    )
    assert reply.usage.prompt_tokens == tokenized["count"]  # type: ignore[union-attr]
    # transformers' tokenizer on the checkpoint's files renders the same history (arguments as the
    # object they stand for).
    reference = reference_tokenizer(dirs[fmt])
    history = json.loads(json.dumps(ROUND_TRIP))
    history[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "celsius": True}
    text = reference.apply_chat_template(history, tools=[WEATHER], add_generation_prompt=True, tokenize=False, **kwargs)
    assert tokenized["tokens"] == reference(text, add_special_tokens=False)["input_ids"]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    if fmt == "qwen3_coder":  # the call in Qwen3.5's format; the prompt thinks unless turned off
        assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=celsius>\nTrue\n" in text
        assert text.endswith("<think>\n\n</think>\n\n" if thinking is False else "<|im_start|>assistant\n<think>\n")
    else:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "celsius": true}}' in text


def test_histories_qwen3_5_s_template_refuses_are_400s_naming_messages(servers: dict[str, Server]) -> None:
    """The template writes a call's arguments as parameters (an object), wants a user query and
    the system message first: histories without them are a 400, and the server goes on."""
    server = servers["qwen3_coder"]
    engine = server.engine_pid()
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}
    for messages, says in (
        ([*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]}], "wrong type"),
        ([{"role": "system", "content": "Be brief."}], "No user query found in messages."),
        ([*MESSAGES, {"role": "system", "content": "Be brief."}], "System message must be at the beginning."),
    ):
        response = server.post("/v1/chat/completions", {"messages": messages, "tools": [WEATHER], "max_tokens": 2})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert says in error["message"] and error["param"] == "messages"
    assert server.health() == 200 and server.engine_pid() == engine
