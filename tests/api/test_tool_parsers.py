"""The tool-call parsers: whole answers read as vLLM's hermes parser reads them, and streams fed
any split of an answer giving what the whole answer gives."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable
from types import FrameType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmserve.api.tool_parsers import (
    ContentDelta,
    HermesToolParser,
    NamedToolParser,
    ParsedOutput,
    RequiredToolParser,
    ToolCall,
    ToolCallDelta,
)


def replay(parser, text: str, cuts: list[int]) -> ParsedOutput:  # type: ignore[no-untyped-def]
    """What a stream fed `text` cut at `cuts` gives, put together as a whole answer."""
    stream = parser.stream()
    events = []
    bounds = [0, *sorted(set(c % (len(text) + 1) for c in cuts)), len(text)]
    for a, b in itertools.pairwise(bounds):
        events += stream.feed(text[a:b])
    events += stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.name is not None:
                assert e.index not in names, "a call's name comes in its first delta only"
                assert e.index == len(names), "calls are numbered in order"
                names[e.index] = e.name
                args[e.index] = ""
            else:
                assert e.index in names, "arguments come after the name"
            args[e.index] += e.arguments
    calls = [ToolCall(names[i], args[i]) for i in sorted(names)]
    return ParsedOutput(content if content.strip() or not calls else None, calls)


WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'


def test_hermes_reads_calls_and_the_text_around_them() -> None:
    parser = HermesToolParser()
    got = parser.parse("Let me look.\n" + WEATHER + "\n" + WEATHER.replace("Paris", "Oslo") + "\n")
    assert got.content == "Let me look.\n"
    assert got.tool_calls == [
        ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}'),
        ToolCall("get_weather", '{"city": "Oslo", "days": [1, 2]}'),
    ]
    # Only calls: content is null. Keys in any order; a block left open is read to the end.
    got = parser.parse(
        '<tool_call>{"arguments": {}, "name": "f"}</tool_call>\n<tool_call>{"name": "g", "arguments": 3}'
    )
    assert got == ParsedOutput(None, [ToolCall("f", "{}"), ToolCall("g", "3")])


def test_hermes_answer_without_valid_calls_is_all_content() -> None:
    parser = HermesToolParser()
    assert parser.parse("plain answer") == ParsedOutput("plain answer", [])
    for bad in ('<tool_call>{"name": "f"}</tool_call>', "<tool_call>{not json}</tool_call>", "<tool_call>[1]"):
        text = "x " + WEATHER + bad
        assert parser.parse(text) == ParsedOutput(text, []), bad


def test_required_and_named_answers() -> None:
    got = RequiredToolParser().parse('[{"name": "f", "parameters": {"a": 1}}, {"parameters": [], "name": "g"}]')
    assert got == ParsedOutput(None, [ToolCall("f", '{"a": 1}'), ToolCall("g", "[]")])
    assert RequiredToolParser().parse("[{") == ParsedOutput("[{", [])
    assert NamedToolParser("f").parse('{"a": 1}') == ParsedOutput(None, [ToolCall("f", '{"a": 1}')])


# Text outside calls: characters that make up the tags too, so partial tags are exercised.
outside = st.text(alphabet='ab <>/_tolc\n{}"', max_size=12).filter(lambda s: "<tool_call>" not in s)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(alphabet='ab"\\<>/ é{}', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("xyz", max_size=3), inner, max_size=3),
    max_leaves=6,
)
names = st.text(alphabet="abc_", min_size=1, max_size=6)
spaces = st.sampled_from(["", " ", "\n", "  "])


@st.composite
def hermes_answers(draw: st.DrawFn) -> str:
    parts = [draw(outside)]
    for _ in range(draw(st.integers(0, 3))):
        args = json.dumps(draw(st.dictionaries(st.text("pq", max_size=3), json_values, max_size=3)))
        obj = {"name": draw(names), "arguments": json.loads(args)}
        if draw(st.booleans()):
            obj = {"arguments": obj["arguments"], "name": obj["name"]}
        sep = draw(spaces)
        body = json.dumps(obj, ensure_ascii=draw(st.booleans()), separators=(",", ":") if sep else None)
        parts.append(f"<tool_call>{sep}{body}{draw(spaces)}</tool_call>{draw(outside)}")
    return "".join(parts)


@settings(max_examples=200, deadline=None)
@given(hermes_answers(), st.lists(st.integers(0, 10_000), max_size=12))
def test_hermes_stream_gives_the_whole_answer_for_any_split(text: str, cuts: list[int]) -> None:
    parser = HermesToolParser()
    whole = parser.parse(text)
    assert replay(parser, text, cuts) == whole
    for call in whole.tool_calls:
        json.loads(call.arguments)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(names, st.dictionaries(st.text("pq", max_size=3), json_values, max_size=3)), min_size=1, max_size=3
    ),
    spaces,
    st.lists(st.integers(0, 10_000), max_size=12),
)
def test_required_stream_gives_the_whole_answer_for_any_split(
    calls: list[tuple[str, dict]], sep: str, cuts: list[int]
) -> None:
    text = sep + "[" + sep + ("," + sep).join(json.dumps({"name": n, "parameters": p}) for n, p in calls) + sep + "]"
    parser = RequiredToolParser()
    whole = parser.parse(text)
    assert [c.name for c in whole.tool_calls] == [n for n, _ in calls]
    assert [json.loads(c.arguments) for c in whole.tool_calls] == [p for _, p in calls]
    assert replay(parser, text, cuts) == whole


def test_stream_sends_arguments_before_the_call_ends() -> None:
    stream = HermesToolParser().stream()
    events = stream.feed('Hi <tool_call>{"name": "f", "arguments": {"q": "ab')
    assert events == [ContentDelta("Hi "), ToolCallDelta(0, "f", ""), ToolCallDelta(0, None, '{"q": "ab')]
    assert stream.feed('c"}}</tool') == [ToolCallDelta(0, None, 'c"}')]
    assert stream.feed("_call>") == []
    assert stream.finish() == []


# -- answers that could hurt the parsers: deep nesting, long blocks -------------------------------

DEEP = 5_000  # past the json module's recursion, however shallow the stack


def deep_call(key: str) -> str:
    """A call whose `key` value (the name or the arguments) is nested DEEP levels."""
    nest = "[" * DEEP + "]" * DEEP
    args_key = "arguments" if key != "parameters" else "parameters"
    return f'{{"name": {nest}, "{args_key}": {{}}}}' if key == "name" else f'{{"name": "f", "{args_key}": {nest}}}'


def test_deep_nesting_in_an_answer_is_content_whole_and_streamed() -> None:
    hermes = HermesToolParser()
    for key in ("name", "arguments"):
        text = "Hi <tool_call>" + deep_call(key) + "</tool_call>"
        assert hermes.parse(text) == ParsedOutput(text, [])
        assert hermes.parse(text.removesuffix("</tool_call>")) == ParsedOutput(text.removesuffix("</tool_call>"), [])
        for step in (1, 7, len(text)):
            replay(hermes, text, list(range(step, len(text), step)))  # ends, whatever it sent
    # Whose name never went out: the stream gives the same plain content.
    text = "Hi <tool_call>" + deep_call("name") + "</tool_call> after"
    assert replay(hermes, text, list(range(0, len(text), 5))) == ParsedOutput(text, [])
    required = RequiredToolParser()
    text = "[" + deep_call("parameters") + "]"
    assert required.parse(text) == ParsedOutput(text, [])
    stream = required.stream()
    for i in range(0, len(text), 9):
        stream.feed(text[i : i + 9])
    stream.finish()


def test_nesting_up_to_the_bound_is_a_call_and_one_more_level_is_content() -> None:
    from vlmserve.api.json_limits import MAX_JSON_DEPTH

    for parser, template, extra in (
        (HermesToolParser(), '<tool_call>{{"name": "f", "arguments": {}}}</tool_call>', 1),  # the object
        (RequiredToolParser(), '[{{"name": "f", "parameters": {}}}]', 2),  # the array and the object
    ):
        fits = MAX_JSON_DEPTH - extra
        args = "[" * fits + "]" * fits
        text = template.format(args)
        assert parser.parse(text) == ParsedOutput(None, [ToolCall("f", args)])
        assert replay(parser, text, list(range(0, len(text), 3))) == parser.parse(text)
        deeper = template.format("[" + args + "]")
        assert parser.parse(deeper) == ParsedOutput(deeper, [])


# Answers each parser reads, streamed cut at every position. (A block found not to be a call
# after its name went out cannot be taken back from a stream: none here.)
HERMES_ANSWERS = [
    "Let me look.\n" + WEATHER + "\n" + WEATHER.replace("Paris", "Oslo") + "\n",
    '<tool_call>{"arguments": {"a": [1, {"b": "}{]["}]}, "name": "f"}</tool_call> and then <tool_call>'
    '{"name": "g", "arguments": 3}',
    '<tool_call>  {"name": "f\\u00e9\\"", "other": [1, "x"], "arguments": "s\\\\"}  </tool_call>',
    '<tool_call>{"name": "f", "arguments": {"k": true, "n": -1.5e3, "z": null}}</tool_call>   ',
    "<tool_call>" + '{"name": "f", "arguments": ' + "[" * 100 + "]" * 100 + "}</tool_call>",
    '<tool_call>{"name": [1], "arguments": {}}</tool_call> tail',  # not a call: all content
    "<tool_call>{not json}</tool_call> x",  # not a call: all content
    "no call <tool_ <tool_call",
]
REQUIRED_ANSWERS = [
    '[{"name": "f", "parameters": {"a": 1}}, {"parameters": [], "name": "g"}]',
    ' [ {"name": "f", "parameters": {"s": "]}[{\\""}} ,{"name": "g", "parameters": ' + "[" * 90 + "]" * 90 + "}]",
]


def test_streams_cut_anywhere_give_the_whole_answer() -> None:
    for parser, answers in ((HermesToolParser(), HERMES_ANSWERS), (RequiredToolParser(), REQUIRED_ANSWERS)):
        for text in answers:
            whole = parser.parse(text)
            assert replay(parser, text, list(range(len(text)))) == whole, text  # a character at a time
            for cut in range(len(text) + 1):
                assert replay(parser, text, [cut]) == whole, (text, cut)


def lines_run(work: Callable[[], object]) -> int:
    """How many lines of vlmserve's API code `work` runs (the parsers are pure Python around a
    few C searches over each delta: the lines they run grow as the work does)."""
    count = 0

    def tracer(frame: FrameType, event: str, arg: object) -> Callable[..., object] | None:
        nonlocal count
        if "vlmserve/api/" not in frame.f_code.co_filename:
            return None
        if event == "line":
            count += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        work()
    finally:
        sys.settrace(previous)
    return count


def fed_by_character(parser, text: str) -> Callable[[], None]:  # type: ignore[no-untyped-def]
    def work() -> None:
        stream = parser.stream()
        for ch in text:
            stream.feed(ch)
        stream.finish()

    return work


# Streams whose call has no complete name yet (or never will): each used to rescan the open block
# from its start on every delta. Each shape is given its length in characters.
GROWING = [
    (HermesToolParser(), lambda n: '<tool_call>{"name": "' + "a" * n),
    (HermesToolParser(), lambda n: "<tool_call>" + '{"a":' * (n // 5)),
    (HermesToolParser(), lambda n: "<tool_call>{" + '"a": [1], ' * (n // 10)),
    (HermesToolParser(), lambda n: '<tool_call>{"arguments": "' + "x" * n),
    (HermesToolParser(), lambda n: '<tool_call>{"' + "k" * n),
    (HermesToolParser(), lambda n: "<tool_call>" + " " * n),
    (HermesToolParser(), lambda n: '<tool_call>{"name": "f", "arguments": {"q": "' + "x" * n),
    (HermesToolParser(), lambda n: '<tool_call>{"name": "f", "arguments": {}}</tool_call>' + " " * n),
    (HermesToolParser(), lambda n: "x" * n),
    (RequiredToolParser(), lambda n: '[{"parameters": {}, "name": "' + "a" * n),
    (RequiredToolParser(), lambda n: "[{" + '"a": 1, ' * (n // 8)),
    (RequiredToolParser(), lambda n: " " * n),
    (RequiredToolParser(), lambda n: '[{"name": "f", "parameters": {"q": "' + "x" * n),
]


@pytest.mark.parametrize(("parser", "shape"), GROWING)
def test_a_stream_costs_what_its_text_costs(parser, shape) -> None:  # type: ignore[no-untyped-def]
    """Four times the text, fed a character at a time, is about four times the work (quadratic
    would be sixteen)."""
    small = lines_run(fed_by_character(parser, shape(400)))
    large = lines_run(fed_by_character(parser, shape(1600)))
    assert large < 5 * small, (small, large)
