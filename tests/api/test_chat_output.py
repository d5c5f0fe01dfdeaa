"""A choice's text as the message the client gets, with both parsers on: reasoning split off
first, tool calls read from the rest; streamed deltas put together give the same message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmserve.api.chat_output import ChatParsing
from vlmserve.api.tool_calling import ChatTool, NamedToolChoice, forced_tool_schema, template_messages
from vlmserve.outputs import CompletionOutput
from vlmserve.tokenizer import Tokenizer

TOOLS = [
    ChatTool.model_validate(
        {
            "type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        }
    ),
    ChatTool.model_validate({"type": "function", "function": {"name": "g"}}),
]
ANSWER = (
    'Think.</think>Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
)


def parsing(tool_choice: object = "auto", **kwargs: object) -> ChatParsing:
    fields = (
        dict(
            chat_template_kwargs=None,
            include_reasoning=True,
            parallel_tool_calls=True,
            reasoning_parser="qwen3",
            tool_call_parser="hermes",
            enable_auto_tool_choice=True,
        )
        | kwargs
    )
    return ChatParsing.for_request(TOOLS, tool_choice, **fields)  # type: ignore[arg-type]


def streamed(p: ChatParsing, text: str, step: int) -> dict:
    stream = p.stream()
    merged: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        delta = stream.feed(piece, final=k == len(pieces) - 1)
        merged["content"] += delta.get("content", "")
        merged["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            entry = merged["tool_calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            entry["name"] = call["function"].get("name", entry["name"])
            entry["arguments"] += call["function"]["arguments"]
    return merged


def test_reasoning_then_calls_whole_and_streamed() -> None:
    message, finish = parsing().message(ANSWER, "stop")
    assert finish == "tool_calls"
    assert (message["reasoning_content"], message["content"]) == ("Think.", "Sure. ")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("f", '{"x": 1}'),
        ("g", "{}"),
    ]
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    for step in (1, 3, 7, 1000):
        got = streamed(parsing(), ANSWER, step)
        assert (got["reasoning_content"], got["content"]) == ("Think.", "Sure. ")
        assert [(c["name"], c["arguments"]) for c in got["tool_calls"].values()] == [("f", '{"x": 1}'), ("g", "{}")]


def test_the_request_s_switches() -> None:
    # parallel_tool_calls false keeps the first call; include_reasoning false drops the reasoning.
    message, _ = parsing(parallel_tool_calls=False, include_reasoning=False).message(ANSWER, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f"]
    assert "reasoning_content" not in message
    assert list(streamed(parsing(parallel_tool_calls=False), ANSWER, 5)["tool_calls"]) == [0]
    # tool_choice none: the text after the reasoning is content, calls and all.
    message, finish = parsing("none").message(ANSWER, "stop")
    assert finish == "stop" and "tool_calls" not in message and message["content"].startswith("Sure. <tool_call>")
    # enable_thinking false: all of it is content. A length cut keeps its finish_reason.
    message, finish = parsing(chat_template_kwargs={"enable_thinking": False}).message(ANSWER, "length")
    assert finish == "length" and message["content"] == "Think.</think>Sure. " and message["reasoning_content"] is None
    # A forced call: no reasoning part (the grammar applies from the first token).
    named = NamedToolChoice.model_validate({"function": {"name": "f"}})
    message, finish = parsing(named).message('{"x": 2}', "stop")
    assert "reasoning" not in message


def test_a_forced_call_s_content_is_empty_and_a_named_one_stops_as_vllm_s() -> None:
    """vLLM (and OpenAI's API): a forced call's content is "", not null; a named function's
    finish_reason is "stop", "required"'s "tool_calls"."""
    named = NamedToolChoice.model_validate({"function": {"name": "f"}})
    message, finish = parsing(named).message('{"x": 2}', "stop")
    assert (message["content"], message["tool_calls"][0]["function"]["arguments"], finish) == ("", '{"x": 2}', "stop")
    stream = parsing(named).stream()
    stream.feed('{"x": 2}', final=True)
    assert stream.finish_reason("stop") == "stop"
    required = '[{"name": "g", "parameters": {}}]'
    message, finish = parsing("required").message(required, "stop")
    assert (message["content"], [c["function"]["name"] for c in message["tool_calls"]], finish) == (
        "",
        ["g"],
        "tool_calls",
    )
    stream = parsing("required").stream()
    stream.feed(required, final=True)
    assert stream.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("cut", ['{"', '{"x": ', '{"x": 2'])
def test_a_forced_call_cut_short_by_max_tokens_is_no_call(cut: str) -> None:
    named = NamedToolChoice.model_validate({"function": {"name": "f"}})
    message, finish = parsing(named).message(cut, "length")
    assert ("tool_calls" not in message, message["content"], finish) == (True, cut, "length")
    message, finish = parsing("required").message('[{"name": "f", "parameters": ' + cut, "length")
    assert "tool_calls" not in message and finish == "length"


def test_reasoning_is_served_under_vllm_s_name_and_the_former_one() -> None:
    message, _ = parsing().message(ANSWER, "stop")
    assert message["reasoning"] == message["reasoning_content"] == "Think."
    delta = parsing().stream().feed(ANSWER, final=True)
    assert delta["reasoning"] == delta["reasoning_content"] == "Think."
    message, _ = parsing(include_reasoning=False).message(ANSWER, "stop")
    assert "reasoning" not in message and "reasoning_content" not in message


def test_auto_needs_the_server_flags() -> None:
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        parsing(enable_auto_tool_choice=False)
    parsing("required", enable_auto_tool_choice=False, tool_call_parser=None)  # forced: no parser needed


def test_forced_schemas_are_vllm_s() -> None:
    named = NamedToolChoice.model_validate({"function": {"name": "g"}})
    assert forced_tool_schema(TOOLS, named, True) == {"type": "object", "properties": {}}
    required = forced_tool_schema(TOOLS, "required", False)
    assert required is not None and (required["minItems"], required["maxItems"]) == (1, 1)
    first = required["items"]["anyOf"][0]
    assert first["properties"]["name"] == {"type": "string", "enum": ["f"]} and first["required"] == [
        "name",
        "parameters",
    ]
    assert forced_tool_schema(TOOLS, "auto", True) is None


def test_history_arguments_become_objects() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": [1]}'}}
    [message] = template_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert message["tool_calls"][0]["function"]["arguments"] == {"x": [1]}
    assert json.loads(call["function"]["arguments"]) == {"x": [1]}  # the request's own message is left as it was
    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\].function.arguments is not valid JSON"):
        template_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])


def test_reasoning_tokens_are_the_tokens_of_the_reasoning(tiny25_dir: Path) -> None:
    """usage.completion_tokens_details.reasoning_tokens: the answer's tokens before `</think>`
    (a leading `<think>` not counted), all of them when it never closed, none with thinking off."""
    tokenizer = Tokenizer(tiny25_dir)
    reasoning, end, rest = (tokenizer.encode(t) for t in ("Think hard, twice.", "</think>", "The answer is 42."))
    lead = tokenizer.encode("<think>")

    def count(ids: list[int], p: ChatParsing | None = None) -> int | None:
        choice = CompletionOutput(0, tokenizer.decode(ids), ids, "stop")
        return (p or parsing()).reasoning_tokens([choice], tokenizer)

    assert len(reasoning) > 3
    assert count(reasoning + end + rest) == len(reasoning)
    assert count(lead + reasoning + end + rest) == len(reasoning)
    assert count(reasoning) == len(reasoning)  # cut short while thinking
    assert count(reasoning + end + rest, parsing(chat_template_kwargs={"enable_thinking": False})) == 0
    assert count(reasoning + end + rest, parsing(reasoning_parser=None)) is None  # no parser: no details
    both = [CompletionOutput(i, tokenizer.decode(reasoning + end), reasoning + end, "stop") for i in range(2)]
    assert parsing().reasoning_tokens(both, tokenizer) == 2 * len(reasoning)


# -- tools with thinking, in both formats ---------------------------------------------------------

XML_CALL = "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"
HERMES_CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
FORMATS = {"hermes": HERMES_CALL, "qwen3_coder": XML_CALL}


def calls(message: dict) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_call_inside_or_right_after_the_reasoning_is_a_call(fmt: str) -> None:
    call = FORMATS[fmt]
    p = parsing(tool_call_parser=fmt)
    for text, reasoning, content in (
        ("Let me look.\n</think>\n\n" + call, "Let me look.\n", None),  # right after it
        ("Let me look.\n" + call, "Let me look.\n", None),  # inside it, never closed
        ("Let me look.\n" + call + "\n</think>\n\nDone.", "Let me look.\n", "\n\n\nDone."),  # closed after it
        (call, "", None),  # at once
    ):
        message, finish = p.message(text, "stop")
        assert (message["reasoning_content"], message["content"], finish) == (reasoning, content, "tool_calls"), text
        assert calls(message) == [("f", {"x": 1})]
        assert "<tool_call>" not in message["reasoning_content"]
    # Thinking turned off (the template closed an empty reasoning): the answer is content and calls.
    off = parsing(tool_call_parser=fmt, chat_template_kwargs={"enable_thinking": False})
    message, _ = off.message("Sure.\n\n" + call, "stop")
    assert (message["reasoning_content"], message["content"], calls(message)) == (None, "Sure.\n\n", [("f", {"x": 1})])
    # Cut short while thinking: all reasoning, no call.
    message, finish = p.message("Let me think about <tool_", "length")
    assert (message["reasoning_content"], message["content"], finish) == ("Let me think about <tool_", None, "length")


def whole_and_streamed(p: ChatParsing, text: str) -> tuple[dict, list[dict]]:
    message, _ = p.message(text, "stop")
    want = {
        "content": message["content"] or "",
        "reasoning_content": message.get("reasoning_content") or "",
        "tool_calls": {
            i: {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for i, c in enumerate(message.get("tool_calls") or [])
        },
    }
    return want, [streamed_cut(p, text, cut) for cut in range(len(text) + 1)]


def streamed_cut(p: ChatParsing, text: str, cut: int) -> dict:
    """The text streamed in two deltas, cut at `cut`, put together (whitespace the stream sent
    as content before a call, which the whole message drops, left out)."""
    stream = p.stream()
    merged: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for piece, final in ((text[:cut], False), (text[cut:], True)):
        delta = stream.feed(piece, final=final)
        merged["content"] += delta.get("content", "")
        merged["reasoning_content"] += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            entry = merged["tool_calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            entry["name"] = call["function"].get("name", entry["name"])
            entry["arguments"] += call["function"]["arguments"]
    if merged["tool_calls"] and not merged["content"].strip():
        merged["content"] = ""
    return merged


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_and_calls_streamed_cut_anywhere_give_the_whole_message(fmt: str, thinking: bool) -> None:
    call = FORMATS[fmt]
    p = parsing(tool_call_parser=fmt, chat_template_kwargs={"enable_thinking": thinking})
    for text in (
        "Hmm, <tool I see.\n</think>\n\nSure. " + call + "\n" + call.replace("1", "2"),
        "<think>\nLet me look.\n" + call + "</think>\n\n",
        "Let me look." + call + " after",
    ):
        want, got = whole_and_streamed(p, text)
        for cut, one in enumerate(got):
            assert one == want, (text, cut)
        assert want["tool_calls"], text


pieces = st.sampled_from(["<think>", "</think>", "</thi", "<tool_call>", "<tool", "\n", "a", " ", "é"])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(pieces, max_size=8).map("".join),
    st.sampled_from(sorted(FORMATS)),
    st.integers(0, 3),
    st.booleans(),
    st.data(),
)
def test_tools_with_thinking_stream_gives_the_whole_message_for_any_split(
    lead: str, fmt: str, n_calls: int, thinking: bool, data: st.DataObject
) -> None:
    """Reasoning text with tags and their pieces, then calls (some inside the reasoning), cut
    anywhere: the stream gives what the whole answer gives."""
    call = FORMATS[fmt]
    text = lead + "".join(data.draw(st.sampled_from(["", "\n", "</think>\n\n", " x "])) + call for _ in range(n_calls))
    text += data.draw(st.sampled_from(["", "</think>", " done"]))
    p = parsing(tool_call_parser=fmt, chat_template_kwargs={"enable_thinking": thinking})
    want, got = whole_and_streamed(p, text)
    for cut, one in enumerate(got):
        assert one == want, (text, cut)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_forced_call_follows_the_reasoning_in_qwen3_5_s_format_only(fmt: str) -> None:
    """On a qwen3_coder server a thinking answer reasons before its forced call (its grammar
    lets it, as vLLM); the JSON forced on other servers applies from the first token."""
    named = NamedToolChoice.model_validate({"function": {"name": "f"}})
    thinking = {
        "hermes": {"required": '[{"name": "f", "parameters": {"x": 1}}]', "named": '{"x": 1}'},
        "qwen3_coder": {"required": "Hmm.\n</think>\n\n" + XML_CALL, "named": "Hmm.\n</think>\n\n" + XML_CALL},
    }[fmt]
    for choice, key in (("required", "required"), (named, "named")):
        message, _ = parsing(choice, tool_call_parser=fmt).message(thinking[key], "stop")
        assert calls(message) == [("f", {"x": 1})] and message["content"] == ""  # forced: "", as vLLM
        assert message.get("reasoning_content", "absent") == ("Hmm.\n" if fmt == "qwen3_coder" else "absent")
    # Thinking off: the template closed the reasoning; the call comes first.
    off = parsing("required", tool_call_parser=fmt, chat_template_kwargs={"enable_thinking": False})
    answer = {"hermes": thinking["required"], "qwen3_coder": XML_CALL}[fmt]
    message, _ = off.message(answer, "stop")
    assert calls(message) == [("f", {"x": 1})] and not message.get("reasoning_content")
