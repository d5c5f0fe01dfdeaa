"""Qwen3.5's tool-call format (`--tool-call-parser qwen3_coder`): whole answers read with their
values typed by the tools' schemas, calls written by the published Qwen3.5 template read back as
the arguments it was given, and streams fed any split of an answer giving what the whole answer
gives, at a cost that grows as the text does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.api.test_tool_parsers import fed_by_character, lines_run, replay
from vlmserve.api.json_limits import MAX_JSON_DEPTH
from vlmserve.api.tool_parsers import ContentDelta, ParsedOutput, ToolCall, ToolCallDelta
from vlmserve.api.xml_tool_parser import XmlToolParser, value_json
from vlmserve.families.qwen3_5.chat_template import QWEN3_5_CHAT_TEMPLATE

SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "scale": {"type": "number"},
            "hot": {"type": "boolean"},
            "where": {"type": "object"},
            "hours": {"type": "array"},
            "note": {"type": ["string", "null"]},
            "level": {"enum": [1, 2, 3]},
        },
    }
}
PARSER = XmlToolParser(SCHEMAS)


def block(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_values_take_the_type_their_schema_gives() -> None:
    text = "Let me look.\n\n" + block(
        "get_weather",
        ("city", "New York\n  (the city)"),
        ("days", "3"),
        ("scale", "-1.5e2"),
        ("hot", "True"),  # the template writes Python's str(True)
        ("where", '{"lat": 40.7, "tags": ["a", "b"]}'),
        ("hours", "[9, 17]"),
        ("note", "None"),
        ("level", "2"),
    )
    got = PARSER.parse(text)
    assert got.content == "Let me look.\n\n"
    [call] = got.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {
        "city": "New York\n  (the city)",
        "days": 3,
        "scale": -150.0,
        "hot": True,
        "where": {"lat": 40.7, "tags": ["a", "b"]},
        "hours": [9, 17],
        "note": None,
        "level": 2,
    }
    assert list(json.loads(call.arguments)) == ["city", "days", "scale", "hot", "where", "hours", "note", "level"]


def test_values_that_are_not_of_their_type_stay_strings() -> None:
    got = PARSER.parse(
        block("get_weather", ("days", "three"), ("hot", "yes"), ("where", "{not json"), ("city", "3"), ("extra", "7"))
    )
    assert json.loads(got.tool_calls[0].arguments) == {
        "days": "three",
        "hot": "yes",
        "where": "{not json",
        "city": "3",  # a string parameter keeps its digits as text
        "extra": "7",  # a parameter the schema does not name: a string
    }
    # A function not among the tools: every value a string.
    got = PARSER.parse(block("other", ("n", "1"), ("b", "true")))
    assert got.tool_calls == [ToolCall("other", '{"n": "1", "b": "true"}')]
    assert value_json(" 12 ", {"integer"}) == "12"
    assert value_json("1.0", {"integer"}) == '"1.0"'
    assert value_json("NaN", {"number"}) == '"NaN"'


def test_several_calls_and_the_text_around_them() -> None:
    text = block("get_weather", ("city", "Paris")) + "\n" + block("get_time") + "\n"
    assert PARSER.parse(text) == ParsedOutput(
        None, [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", "{}")]
    )
    # Newlines: one dropped at each end of a value, the others kept.
    got = PARSER.parse("<tool_call><function=f><parameter=a>\n\nx\n\n</parameter></function></tool_call> after")
    assert got == ParsedOutput(" after", [ToolCall("f", '{"a": "\\nx\\n"}')])
    # A block left open at the end of the answer is read to the end (its </function> is needed).
    assert PARSER.parse("<tool_call>\n<function=f>\n</function>") == ParsedOutput(None, [ToolCall("f", "{}")])


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>\n<function=f>\n<parameter=a>\nopen",  # a parameter left open
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>",  # no </function>
        "<tool_call>\nplain text</tool_call>",
        "<tool_call>\n<function=f>\nstray text\n</function>\n</tool_call>",
        "<tool_call>\n<function=f\ng>\n</function>\n</tool_call>",  # a name across lines
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n</function>\ntext</tool_call>",
        "<tool_call>\n<function=" + "f" * 2000 + ">\n</function>\n</tool_call>",
        "<tool_call>",
    ],
)
def test_an_answer_with_a_block_that_is_not_a_call_is_all_content(bad: str) -> None:
    text = "Hi " + block("f", ("a", "1")) + bad
    assert PARSER.parse(text) == ParsedOutput(text, [])
    replay(PARSER, text, list(range(0, len(text), 3)))  # the stream ends, whatever it sent
    # Whose name never went out: the stream gives the same plain content.
    if "<function=f>" not in bad:
        assert replay(PARSER, bad + " tail", [4, 9]) == ParsedOutput(bad + " tail", [])


def test_values_nested_past_the_bound_are_content_and_up_to_it_a_call() -> None:
    # The arguments object is one level: a value may nest one level less than JSON's bound.
    fits = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
    text = block("get_weather", ("hours", fits))
    assert json.loads(PARSER.parse(text).tool_calls[0].arguments)["hours"] is not None
    for deeper in ("[" + fits + "]", "[" * 100_000 + "]" * 100_000):
        text = block("get_weather", ("hours", deeper))
        assert PARSER.parse(text) == ParsedOutput(text, [])
        replay(PARSER, text, list(range(0, len(text), 997)))


# -- the published template writes calls the parser reads back -----------------------------------


def rendered_calls(tiny35_dir: Path, arguments: list[dict]) -> str:
    """The answer of a history's assistant turn holding these calls, as transformers renders it
    with the tiny Qwen3.5 checkpoint's (the published) template."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny35_dir))
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": a}} for a in arguments]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return text.split("<|im_start|>assistant\n<think>\n\n</think>\n\n", 1)[1].removesuffix("<|im_end|>\n")


def test_the_published_template_writes_calls_the_parser_reads_back(tiny35_dir: Path) -> None:
    arguments = [
        {"city": "Paris", "days": 3, "scale": 0.5, "hot": False, "note": None, "level": 1},
        {"where": {"lat": 1.5, "names": ["é", "<b>"]}, "hours": [], "city": "two\nlines"},
    ]
    text = rendered_calls(tiny35_dir, arguments)
    assert text.startswith("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n")
    got = PARSER.parse(text)
    assert got.content is None
    assert [json.loads(c.arguments) for c in got.tool_calls] == arguments
    assert replay(PARSER, text, list(range(len(text)))) == got


# -- streams --------------------------------------------------------------------------------------


def test_stream_sends_the_name_then_a_string_value_as_it_arrives() -> None:
    stream = PARSER.stream()
    assert stream.feed("Hi <tool_call>\n<function=get_wea") == [ContentDelta("Hi ")]
    assert stream.feed('ther>\n<parameter=city>\nNew "Yo') == [
        ToolCallDelta(0, "get_weather", ""),
        ToolCallDelta(0, None, '{"city": "New \\"Yo'),
    ]
    assert stream.feed("rk\n</param") == [ToolCallDelta(0, None, "rk")]  # the newline held
    assert stream.feed("eter>\n<parameter=days>\n1") == [ToolCallDelta(0, None, '", "days": ')]
    assert stream.feed("2\n</parameter>\n</function>") == [ToolCallDelta(0, None, "12}")]
    assert stream.feed("\n</tool_call>") == []
    assert stream.finish() == []


# Answers read, streamed cut at every position. (A block found not to be a call after its name
# went out cannot be taken back from a stream: none here.)
ANSWERS = [
    "Let me look.\n\n" + block("get_weather", ("city", "Paris </par"), ("days", "3"), ("where", '{"a": "<"}')),
    block("get_weather", ("note", "null"), ("hot", "false")) + "\n" + block("f") + "\n\nDone.\n",
    "<tool_call><function=f><parameter=a>\n\n\n</parameter></function></tool_call>",
    "no call <tool_ <tool_call",
    "x <tool_call>\nnot a call</tool_call> y " + block("f"),  # not a call: all content
]


def test_streams_cut_anywhere_give_the_whole_answer() -> None:
    for text in ANSWERS:
        whole = PARSER.parse(text)
        assert replay(PARSER, text, list(range(len(text)))) == whole, text
        for cut in range(len(text) + 1):
            assert replay(PARSER, text, [cut]) == whole, (text, cut)


outside = st.text(alphabet="ab <>/_tolcfunp=\n", max_size=12).filter(lambda s: "<tool_call>" not in s)
values = st.text(alphabet='ab \n<>/"\\é{}[]01', max_size=10).filter(lambda s: "</parameter>" not in s)
typed = st.sampled_from(["city", "days", "hot", "where", "note", "nope"])


@st.composite
def answers(draw: st.DrawFn) -> str:
    parts = [draw(outside)]
    for _ in range(draw(st.integers(0, 3))):
        params = draw(
            st.lists(st.tuples(typed, values | st.sampled_from(["1", "-2", "True", "None", '{"k": [1]}'])), max_size=3)
        )
        sep = draw(st.sampled_from(["", "\n", "\n\n"]))
        body = "".join(f"<parameter={k}>{sep}{v}{sep}</parameter>{sep}" for k, v in params)
        name = draw(st.sampled_from(["get_weather", "f"]))
        parts.append(f"<tool_call>{sep}<function={name}>{sep}{body}</function>{sep}</tool_call>{draw(outside)}")
    return "".join(parts)


@settings(max_examples=300, deadline=None)
@given(answers(), st.lists(st.integers(0, 10_000), max_size=12))
def test_stream_gives_the_whole_answer_for_any_split(text: str, cuts: list[int]) -> None:
    whole = PARSER.parse(text)
    assert replay(PARSER, text, cuts) == whole
    for call in whole.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)


GROWING = [
    lambda n: "<tool_call>\n<function=" + "a" * min(n, 1000),
    lambda n: "<tool_call>\n<function=f>\n<parameter=city>\n" + "x" * n,
    lambda n: "<tool_call>\n<function=get_weather>\n<parameter=where>\n" + '{"a": ' * (n // 6),
    lambda n: "<tool_call>\n<function=f>\n<parameter=a>\n" + "</para" * (n // 6),
    lambda n: "<tool_call>\n<function=f>\n" + "\n" * n,
    lambda n: block("f", ("a", "1")) + " " * n,
    lambda n: "x" * n,
    lambda n: "<tool_" * (n // 6),
]


@pytest.mark.parametrize("shape", GROWING)
def test_a_stream_costs_what_its_text_costs(shape) -> None:  # type: ignore[no-untyped-def]
    """Four times the text, fed a character at a time, is about four times the work."""
    small = lines_run(fed_by_character(PARSER, shape(400)))
    large = lines_run(fed_by_character(PARSER, shape(1600)))
    assert large < 5 * small, (small, large)


def test_the_tiny_checkpoint_ships_the_published_template(tiny35_dir: Path) -> None:
    assert (tiny35_dir / "chat_template.jinja").read_text() == QWEN3_5_CHAT_TEMPLATE
    assert not (tiny35_dir / "chat_template.json").exists()


fragments = st.sampled_from(
    ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", "<tool_", "</par"]
    + ["get_weather", "days", "where", ">", "\n", " ", "x", "1", "{", "[", "True", "é"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(fragments, max_size=30).map("".join), st.lists(st.integers(0, 10_000), max_size=8))
def test_any_text_is_read_without_error_and_its_calls_are_json(text: str, cuts: list[int]) -> None:
    """Model output of the format's pieces in any order: whole and streamed, never an error; a
    call's arguments are a JSON object; without calls the whole answer is its content."""
    whole = PARSER.parse(text)
    for call in whole.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
    if not whole.tool_calls:
        assert whole.content == text
    streamed = replay(PARSER, text, cuts)
    if whole.tool_calls:  # a stream that read calls gives them as the whole answer does
        assert streamed == whole
