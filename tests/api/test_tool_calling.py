"""A history's tool calls made ready for the chat template: arguments sent as JSON text become
the object they stand for, within the bounds of JSON (json_limits)."""

from __future__ import annotations

import pytest

from vlmserve.api.json_limits import MAX_JSON_DEPTH
from vlmserve.api.tool_calling import template_messages


def history(arguments: object) -> list[dict]:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]


def arguments_of(messages: list[dict]) -> object:
    return messages[1]["tool_calls"][0]["function"]["arguments"]


def test_arguments_as_text_become_the_object() -> None:
    assert arguments_of(template_messages(history('{"city": "Paris"}'))) == {"city": "Paris"}
    assert arguments_of(template_messages(history(" "))) == {}
    assert arguments_of(template_messages(history({"a": 1}))) == {"a": 1}
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"):
        template_messages(history("{"))


@pytest.mark.parametrize("n", [MAX_JSON_DEPTH + 1, 5_000, 100_000])
def test_arguments_nested_past_the_bound_are_a_value_error_naming_them(n: int) -> None:
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is nested more than"):
        template_messages(history("[" * n + "]" * n))
    fits = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert arguments_of(template_messages(history(fits))) is not None
