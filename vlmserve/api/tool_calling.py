"""Tool calling in a chat request, as vLLM serves it: the `tools` and `tool_choice` fields, the
grammar that forces a call for tool_choice "required" or a named function, the parser that reads
the answer back, and the history's tool calls made ready for the chat template.

tool_choice:
- "none" (the default without tools): the tools are still rendered into the prompt (as vLLM does)
  but the answer is never parsed for calls.
- "auto" (the default with tools): the model decides; its answer is read by the server's
  `--tool-call-parser` (hermes: JSON in `<tool_call>` blocks, the Qwen2.5 / Qwen3-VL templates';
  qwen3_coder: Qwen3.5's XML blocks), which needs `--enable-auto-tool-choice` (as vLLM).
- "required": the answer is forced to vLLM's JSON array of {"name", "parameters"}, one item per
  call (at least one; at most one with parallel_tool_calls false); on a qwen3_coder server, to
  that many calls in Qwen3.5's format (xml_tool_grammar.py), the format the model knows, after
  the model's reasoning when the reasoning parser reads a thinking answer (as vLLM).
- {"type": "function", "function": {"name": ...}}: the answer is forced to that function's
  parameters schema; on a qwen3_coder server, to one call of it in Qwen3.5's format.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool

from vlmserve.api.json_limits import JSONLimitError, loads_bounded
from vlmserve.api.tool_parsers import HermesToolParser, NamedToolParser, RequiredToolParser
from vlmserve.api.xml_tool_grammar import forced_call_grammar
from vlmserve.api.xml_tool_parser import XmlToolParser
from vlmserve.parser_names import XML_TOOL_CALL_PARSER

MAX_TOOLS = 128


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str = Field(min_length=1, max_length=256)


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tool_choice(tools: list[ChatTool] | None, tool_choice: ToolChoice | None) -> None:
    """vLLM's rules (ValueError naming the field): a tool_choice other than "none" needs tools,
    and a named function must be one of them; and no two tools of one name."""
    seen = set()
    for i, tool in enumerate(tools or []):
        if tool.function.name in seen:
            raise ValueError(f"tools[{i}]: a second function named {tool.function.name!r}")
        seen.add(tool.function.name)
    if tool_choice is None or tool_choice == "none":
        return
    if not tools:
        raise ValueError("tool_choice: when using `tool_choice`, `tools` must be set")
    if isinstance(tool_choice, NamedToolChoice):
        names = [tool.function.name for tool in tools]
        if tool_choice.function.name not in names:
            raise ValueError(f"tool_choice: the function {tool_choice.function.name!r} is not among `tools`")


def effective_tool_choice(tools: list[ChatTool] | None, tool_choice: ToolChoice | None) -> ToolChoice:
    if tool_choice is not None:
        return tool_choice
    return "auto" if tools else "none"


def _parameters(tool: ChatTool) -> dict[str, Any]:
    # A function without parameters takes an empty object (vLLM's rule).
    return tool.function.parameters or {"type": "object", "properties": {}}


# Keywords whose values are data, not schemas: a {"$ref": ...} inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _moved_refs(schema: Any, root: str) -> Any:
    """A copy of `schema` whose local references ("#", "#/...") point into it as it sits at the
    JSON pointer `root` of a larger schema. Each tool's parameters keep their own definitions
    ($defs, definitions) where they are, so two tools may define the same name differently."""
    if isinstance(schema, list):
        return [_moved_refs(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            moved[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            moved[key] = value
        else:
            moved[key] = _moved_refs(value, root)
    return moved


def forced_tool_schema(
    tools: list[ChatTool] | None, tool_choice: ToolChoice, parallel_tool_calls: bool
) -> dict[str, Any] | None:
    """The JSON schema the answer is forced to, for "required" and a named function (vLLM's).
    For "required" each tool's parameters sit inside the array's schema: their local references
    ($ref "#/$defs/..." as pydantic writes them) are moved to point where they now are."""
    if not tools:
        return None
    if isinstance(tool_choice, NamedToolChoice):
        return next(_parameters(t) for t in tools if t.function.name == tool_choice.function.name)
    if tool_choice != "required":
        return None
    item = {
        "type": "object",
        "anyOf": [
            {
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": _moved_refs(_parameters(t), f"#/items/anyOf/{i}/properties/parameters"),
                },
                "required": ["name", "parameters"],
            }
            for i, t in enumerate(tools)
        ],
    }
    return {"type": "array", "minItems": 1, "items": item} | ({} if parallel_tool_calls else {"maxItems": 1})


def reasons_before_forced_calls(tool_call_parser: str | None, reasoning_parser: str | None, thinking: bool) -> bool:
    """Whether a forced call comes after the model's reasoning: on a qwen3_coder server whose
    reasoning parser reads a thinking answer (vLLM constrains only what follows `</think>`; the
    JSON forced on other servers applies from the first token)."""
    return tool_call_parser == XML_TOOL_CALL_PARSER and reasoning_parser is not None and thinking


def forced_tool_grammar(
    tools: list[ChatTool] | None, tool_choice: ToolChoice, parallel_tool_calls: bool, reasoning: bool = False
) -> str | None:
    """The EBNF grammar the answer is forced to on a qwen3_coder server, for "required" and a
    named function: calls in Qwen3.5's format (after the reasoning, with `reasoning`)."""
    if not tools or not (isinstance(tool_choice, NamedToolChoice) or tool_choice == "required"):
        return None
    offered = [(t.function.name, _parameters(t)) for t in tools]
    if isinstance(tool_choice, NamedToolChoice):
        named = [f for f in offered if f[0] == tool_choice.function.name]
        return forced_call_grammar(named, parallel=False, reasoning=reasoning)
    return forced_call_grammar(offered, parallel=parallel_tool_calls, reasoning=reasoning)


def _schemas(tools: list[ChatTool]) -> dict[str, Any]:
    return {t.function.name: _parameters(t) for t in tools}


ToolParser = HermesToolParser | RequiredToolParser | NamedToolParser | XmlToolParser


def tool_parser(
    tools: list[ChatTool] | None, tool_choice: ToolChoice, auto_parser: str | None, auto_enabled: bool
) -> ToolParser | None:
    """The parser that reads the answer back into tool calls (None: the answer is content).
    ValueError when "auto" is asked of a server not started for it."""
    if not tools or tool_choice == "none":
        return None
    xml = auto_parser == XML_TOOL_CALL_PARSER
    if isinstance(tool_choice, NamedToolChoice):
        return XmlToolParser(_schemas(tools)) if xml else NamedToolParser(tool_choice.function.name)
    if tool_choice == "required":
        return XmlToolParser(_schemas(tools)) if xml else RequiredToolParser()
    if not auto_enabled or auto_parser is None:
        raise ValueError(
            'tool_choice: "auto" tool choice requires the server to be started with --enable-auto-tool-choice '
            "and --tool-call-parser"
        )
    return XmlToolParser(_schemas(tools)) if xml else HermesToolParser()


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as the chat templates read it: an assistant message's tool call arguments,
    which OpenAI's clients send as JSON text, as the object they write (as vLLM does; the Qwen
    templates write them with `tojson`). ValueError naming the message when they are not JSON, or
    are JSON past the bounds of json_limits (the template would recurse through them too)."""
    out = []
    for mi, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not calls:
            out.append(message)
            continue
        if not isinstance(calls, list):
            raise ValueError(f"messages[{mi}].tool_calls must be a list")
        fixed = []
        for ci, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f"messages[{mi}].tool_calls[{ci}] needs a function with a name")
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                where = f"messages[{mi}].tool_calls[{ci}].function.arguments"
                try:
                    arguments = loads_bounded(arguments) if arguments.strip() else {}
                except JSONLimitError as e:
                    raise ValueError(f"{where} {e}") from None
                except ValueError:
                    raise ValueError(f"{where} is not valid JSON") from None
            fixed.append(call | {"function": function | {"arguments": arguments}})
        out.append(message | {"tool_calls": fixed})
    return out
