"""A history's tool calls made ready for the chat template: arguments sent as JSON text become
the object they stand for, within the bounds of JSON (json_limits). And the schema a forced call
is held to (tool_choice "required"), checked by the grammar built from it."""

from __future__ import annotations

import json

import pytest

from vlmserve.api.json_limits import MAX_JSON_DEPTH
from vlmserve.api.tool_calling import ChatTool, NamedToolChoice, forced_tool_schema, template_messages


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


def _weather(name: str, options: dict, *, ref: str = "#/$defs/Options") -> ChatTool:
    """A tool whose parameters are written as pydantic writes them: a $ref into their own $defs."""
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "options": {"$ref": ref}},
        "required": ["city", "options"],
        "additionalProperties": False,
        "$defs": {"Options": options},
    }
    return ChatTool.model_validate({"type": "function", "function": {"name": name, "parameters": parameters}})


def _accepts(schema: dict, value: object) -> bool:
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return bool(xgrammar.testing._is_grammar_accept_string(grammar, json.dumps(value)))


def test_required_with_defs_compiles_and_each_tool_keeps_its_own_definitions() -> None:
    """tool_choice "required" nests each tool's parameters in one array schema: their "#/$defs/..."
    references must still find their definitions, and two tools may use one name for different
    ones (pydantic names them after the model class)."""
    by_count = _weather("by_count", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    by_unit = _weather(
        "by_unit", {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"]}
    )
    schema = forced_tool_schema([by_count, by_unit], "required", True)
    assert schema is not None
    call = lambda name, options: [{"name": name, "parameters": {"city": "Oslo", "options": options}}]  # noqa: E731
    assert _accepts(schema, call("by_count", {"n": 3}))
    assert _accepts(schema, call("by_unit", {"unit": "C"}))
    assert not _accepts(schema, call("by_count", {"unit": "C"}))  # each tool reads its own Options
    assert not _accepts(schema, call("by_unit", {"n": 3}))
    assert _accepts(schema, call("by_count", {"n": 1}) + call("by_unit", {"unit": "F"}))
    # The request's tools are left as they were (their $defs and references).
    assert by_count.function.parameters["properties"]["options"] == {"$ref": "#/$defs/Options"}  # type: ignore[index]
    # A named choice of the same tool forces its parameters as they are.
    named = forced_tool_schema(
        [by_count, by_unit], NamedToolChoice.model_validate({"function": {"name": "by_unit"}}), True
    )
    assert named == by_unit.function.parameters


def test_required_with_a_reference_to_the_parameters_root() -> None:
    """A recursive schema ("$ref": "#", a tree) points at the tool's parameters, not the array."""
    tree = {
        "type": "object",
        "properties": {"label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["label"],
        "additionalProperties": False,
    }
    tool = ChatTool.model_validate({"type": "function", "function": {"name": "tree", "parameters": tree}})
    schema = forced_tool_schema([tool], "required", True)
    assert schema is not None
    nested = {"label": "a", "children": [{"label": "b", "children": [{"label": "c"}]}]}
    assert _accepts(schema, [{"name": "tree", "parameters": nested}])
    assert not _accepts(schema, [{"name": "tree", "parameters": {"label": "a", "children": [[]]}}])
