"""The Qwen3 reasoning parser: whole answers split as vLLM's qwen3 parser splits them, and streams
fed any split of an answer giving the same reasoning and content."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from vlmserve.api.reasoning import ReasoningSplit, ThinkReasoningParser


def test_whole_answers() -> None:
    parser = ThinkReasoningParser()
    # The template put <think> in the prompt: the answer starts inside the reasoning.
    assert parser.parse("step 1\n</think>\n\nThe answer") == ReasoningSplit("step 1\n", "\n\nThe answer")
    # The model wrote <think> itself.
    assert parser.parse("<think>hmm</think>yes") == ReasoningSplit("hmm", "yes")
    # Cut short while thinking: all reasoning; nothing after </think>: content null.
    assert parser.parse("still thinking") == ReasoningSplit("still thinking", None)
    assert parser.parse("done</think>") == ReasoningSplit("done", None)
    # Thinking turned off in the request: all content.
    assert ThinkReasoningParser(thinking_enabled=False).parse("an answer") == ReasoningSplit(None, "an answer")


def replay(parser: ThinkReasoningParser, text: str, cuts: list[int]) -> tuple[str, str]:
    stream = parser.stream()
    bounds = [0, *sorted(set(c % (len(text) + 1) for c in cuts)), len(text)]
    reasoning = content = ""
    for a, b in itertools.pairwise(bounds):
        r, c = stream.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


pieces = st.sampled_from(
    ["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "a", "é", "</thin", "<tool_call>", "<tool_c"]
)


@settings(max_examples=250, deadline=None)
@given(
    st.lists(pieces, max_size=14).map("".join),
    st.lists(st.integers(0, 1000), max_size=10),
    st.booleans(),
    st.sampled_from([None, "<tool_call>"]),
)
def test_stream_gives_the_whole_answer_for_any_split(
    text: str, cuts: list[int], thinking: bool, call_start: str | None
) -> None:
    parser = ThinkReasoningParser(thinking_enabled=thinking, call_start=call_start)
    whole = parser.parse(text)
    assert replay(parser, text, cuts) == (whole.reasoning or "", whole.content or "")


def test_a_call_begun_inside_the_reasoning_ends_it() -> None:
    parser = ThinkReasoningParser(call_start="<tool_call>")
    call = "<tool_call>\n<function=f>\n</function>\n</tool_call>"
    assert parser.parse("Look.\n" + call) == ReasoningSplit("Look.\n", call)
    # The model's </think> after the call is dropped; what follows is content.
    assert parser.parse("Look." + call + "\n</think>\n\nok") == ReasoningSplit("Look.", call + "\n\n\nok")
    # After </think>, as before; without tool parsing, a call is reasoning text.
    assert parser.parse("Look.</think>" + call) == ReasoningSplit("Look.", call)
    assert ThinkReasoningParser().parse("Look." + call) == ReasoningSplit("Look." + call, None)
    stream = parser.stream()
    assert stream.feed("Look.<tool_") == ("Look.", "")
    assert stream.feed("call>x</thi") == ("", "<tool_call>x")
    assert stream.feed("nk>y") == ("", "y")


def test_stream_holds_back_only_a_possible_tag() -> None:
    stream = ThinkReasoningParser().stream()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>so") == ("so", "")
    assert stream.feed(" </th") == (" ", "")
    assert stream.feed("ink>ok") == ("", "ok")


def test_a_stream_keeps_only_the_text_it_holds_back() -> None:
    """Each delta costs its own length: what the stream keeps between deltas is the possible
    tag it holds back, not the answer so far."""
    stream = ThinkReasoningParser().stream()
    reasoning = ""
    for ch in "  <think>" + "x" * 500 + "</think>" + "y" * 500:
        got, _ = stream.feed(ch)
        reasoning += got
        assert len(stream.text) < len(ThinkReasoningParser.END)
    assert reasoning == "x" * 500
