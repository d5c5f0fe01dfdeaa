"""Qwen3.5's tool-call format (vLLM's `--tool-call-parser qwen3_coder`, also Qwen3-Coder's), read
back as OpenAI tool calls, whole or streamed. The published Qwen3.5 chat template asks for

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

and writes the history's calls the same way (a string as it is, anything else as JSON or Python's
`str`: `True`, `None`). A value is the text between `<parameter=KEY>` and the first
`</parameter>`, one newline dropped at each end, converted by the type its tool's JSON schema
gives the parameter: "string" (or no type, or a parameter the schema does not name) keeps the text;
"integer", "number", "boolean", "null", "object" and "array" take the text when it is one (JSON;
`True`/`False`/`None` as Python writes them), else the value stays a string. `arguments` is the
JSON object of the values in the order written (`{"city": "Paris", "days": 3}`).

As the hermes parser (tool_parsers.py): the text outside the blocks is the content; a block left
open at the end of the answer is read to the end (its `</function>` is still needed); if any block
is not a call (other text between the tags, a parameter left open, a value nested past
json_limits' bound), the answer has no calls and all of it is content.

The stream gives a call's name as soon as `<function=NAME>` is complete, then its arguments: a
string value as it arrives (JSON-escaped; a newline and a possible start of `</parameter>` held
back), any other value when its parameter closes. Fed any split of an answer, it gives what
`parse` gives; its work per delta is proportional to the delta (a block's text is read once)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from vlmserve.api.json_limits import MAX_JSON_DEPTH, JSONLimitError, loads_bounded
from vlmserve.api.tool_parsers import (
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    content_beside_calls,
    held_prefix,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"
# A function's or parameter's name: at most this long, on one line, without `<` (else the block
# is not a call). Function names in a request are at most 256 characters (tool_calling.py).
MAX_NAME_CHARS = 1024

_NOT_WS = re.compile(r"[^ \t\n\r]")
_NAME_BREAK = re.compile(r"[<\n]")
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_PYTHON_LITERALS = {"true": "true", "false": "false", "null": "null", "none": "null"}
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (dict, "object"))


class NotACall(ValueError):
    """A block that is not a call (the whole answer is then content)."""


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema admits: its `type` (a name or a list), those of its
    `anyOf` / `oneOf` options (one level), or those of its `enum` / `const` values. Empty: not said."""
    if not isinstance(schema, Mapping):
        return set()
    types: set[str] = set()
    for option in [schema, *_options(schema)]:
        kind = option.get("type")
        if isinstance(kind, str):
            types.add(kind)
        elif isinstance(kind, list):
            types.update(k for k in kind if isinstance(k, str))
    if not types:
        enum = schema.get("enum")
        values = (enum if isinstance(enum, list) else []) + ([schema["const"]] if "const" in schema else [])
        for value in values:
            types.add(_json_type(value))
    return types


def _options(schema: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    options = []
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            options += [o for o in schema[key] if isinstance(o, Mapping)]
    return options


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, list):
        return "array"
    return next((name for kind, name in _ENUM_TYPES if isinstance(value, kind)), "string")


def is_text(types: set[str]) -> bool:
    """A value of these types is its text, as written (streamed as it arrives)."""
    return not types or types == {"string"}


def value_json(raw: str, types: set[str]) -> str:
    """The JSON text of a parameter's value `raw` (its newlines already dropped) for a parameter
    of `types`. NotACall for a value nested past json_limits' bound (as the hermes parser)."""
    if is_text(types):
        return json.dumps(raw, ensure_ascii=False)
    text = raw.strip()
    literal = _PYTHON_LITERALS.get(text.lower())
    if literal == "null" and "null" in types:
        return "null"
    if literal in ("true", "false") and "boolean" in types:
        return literal
    if ("integer" in types or "number" in types) and _INTEGER.fullmatch(text):
        return text
    if "number" in types and _NUMBER.fullmatch(text):
        return text
    if types & {"object", "array"} and text[:1] in "[{":
        try:
            value = loads_bounded(text, MAX_JSON_DEPTH - 1)  # inside the arguments object
            return json.dumps(value, ensure_ascii=False, allow_nan=False)
        except JSONLimitError as e:
            raise NotACall(f"a value {e}") from None
        except ValueError:
            pass
    return json.dumps(raw, ensure_ascii=False)


def parameter_types(schemas: Mapping[str, Any], function: str) -> dict[str, set[str]]:
    """Each parameter's types, for a function of the request's tools (none known for others)."""
    schema = schemas.get(function)
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    if not isinstance(properties, Mapping):
        return {}
    return {str(key): schema_types(value) for key, value in properties.items()}


class XmlToolParser:
    """`<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`
    blocks (vLLM's qwen3_coder parser). `schemas`: each offered function's parameters schema."""

    START = TOOL_CALL_START

    def __init__(self, schemas: Mapping[str, Any] | None = None) -> None:
        self.schemas: Mapping[str, Any] = schemas or {}

    def parse(self, text: str) -> ParsedOutput:
        stream = XmlToolStream(self)
        events = stream.feed(text) + stream.finish()
        if stream.failed:
            return ParsedOutput(text, [])
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        calls: list[ToolCall] = []
        for e in events:
            if isinstance(e, ToolCallDelta):
                if e.name is not None:
                    calls.append(ToolCall(e.name, ""))
                calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + e.arguments)
        return ParsedOutput(content if content.strip() or not calls else None, calls)

    def stream(self) -> XmlToolStream:
        return XmlToolStream(self)


def _merged(events: list[StreamEvent]) -> list[StreamEvent]:
    """Consecutive argument pieces of one call as one delta (after the delta with its name)."""
    out: list[StreamEvent] = []
    for e in events:
        last = out[-1] if out else None
        if (
            isinstance(e, ToolCallDelta)
            and isinstance(last, ToolCallDelta)
            and e.name is None
            and last.name is None
            and last.index == e.index
        ):
            out[-1] = ToolCallDelta(last.index, None, last.arguments + e.arguments)
        else:
            out.append(e)
    return out


class XmlToolStream:
    """XmlToolParser fed text deltas: a state machine over the block's parts (between
    blocks; before `<function=`; the name; between parameters; a parameter's name; its value;
    after `</function>`). Text outside blocks streams as content, a possible start of
    `<tool_call>` held back, and whitespace after a call held until text follows it (the whole
    answer drops trailing whitespace), as the hermes stream does.

    NOTE: only the text not yet consumed is kept (at most a tag's length held back, plus the
    delta), and a name or a non-string value is collected in parts and joined once, when it
    ends: the work per delta is proportional to the delta."""

    def __init__(self, parser: XmlToolParser) -> None:
        self.parser = parser
        self.pending = ""  # text not yet consumed, from self.pos on
        self.pos = 0
        self.state = "text"
        self.calls = 0  # blocks read as calls (the open one included once its name went out)
        self.held_space: list[str] = []  # whitespace after a call, not yet sent
        self.failed = False  # a block was not a call: the rest is content
        self.raw: list[str] = []  # the open block's text while its name has not gone out
        self.parts: list[str] = []  # the name or value being read
        self.parts_chars = 0
        self.types: dict[str, set[str]] = {}  # the open call's parameter types
        self.value_types: set[str] = set()
        self.value_started = False  # the value's first character has come (a newline there dropped)
        self.held_newline = False  # a string value's last newline, sent unless `</parameter>` follows
        self.params = 0  # parameters of the open call

    def feed(self, delta: str) -> list[StreamEvent]:
        self.pending += delta
        return _merged(self._advance(final=False))

    def finish(self) -> list[StreamEvent]:
        events = self._advance(final=True)
        self.held_space = []
        return _merged(events)

    # -- content -----------------------------------------------------------------------------

    def _content(self, text: str) -> list[StreamEvent]:
        return content_beside_calls(text, bool(self.calls), self.held_space)

    def _fail(self) -> list[StreamEvent]:
        """The open block is not a call: no later block is read (the whole answer has no calls; a
        stream cannot take back). Whose name has not gone out is content, with the rest of the
        answer; whose name has, the rest of it is dropped up to its `</tool_call>`."""
        self.failed = True
        if self.state in ("open", "name"):
            raw = "".join(self.raw) + self.pending[self.pos :]
            self.state, self.raw, self.pos = "text", [], len(self.pending)
            return self._content(raw)
        self.state = "skip"
        return []

    # -- the machine ---------------------------------------------------------------------------
    # Each step reads self.pending from self.pos on (NOTE: never slicing off what it consumed, which
    # would copy the rest each time: a whole answer is fed at once); _advance drops what they read.

    def _advance(self, final: bool) -> list[StreamEvent]:
        """Steps of the machine until one needs more text. A step gives its events ([] for none),
        None when it needs more text (or the text is done), False when the block is not a call."""
        steps = {
            "text": self._text,
            "open": self._open,
            "name": self._name,
            "body": self._body,
            "key": self._key,
            "value": self._value,
            "close": self._close,
            "skip": self._skip,
        }
        events: list[StreamEvent] = []
        while True:
            step = steps[self.state](final)
            if step is None:
                self.pending, self.pos = self.pending[self.pos :], 0
                return events
            events += self._fail() if isinstance(step, bool) else step

    def _take(self, end: int) -> str:
        """Consume the pending text up to `end` (kept as the block's raw text until its name is out)."""
        taken, self.pos = self.pending[self.pos : end], end
        if self.state in ("open", "name"):
            self.raw.append(taken)
        return taken

    def _expect(self, final: bool, *tags: str) -> str | bool | None:
        """After whitespace, which of `tags` comes next (consumed): the tag; False when none can;
        None while more text is needed to tell."""
        m = _NOT_WS.search(self.pending, self.pos)
        self._take(len(self.pending) if m is None else m.start())
        rest = self.pending[self.pos : self.pos + max(map(len, tags))]
        for tag in tags:
            if rest.startswith(tag):
                self._take(self.pos + len(tag))
                return tag
        if not final and any(tag.startswith(rest) for tag in tags):
            return None
        return False

    def _text(self, final: bool) -> list[StreamEvent] | None:
        if self.pos == len(self.pending):
            return None
        k = -1 if self.failed else self.pending.find(TOOL_CALL_START, self.pos)
        if k < 0:
            held = 0 if final else held_prefix(self.pending, TOOL_CALL_START, self.pos)
            end = len(self.pending) - held
            events = self._content(self.pending[self.pos : end])
            self.pos = end
            return events or None
        events = self._content(self.pending[self.pos : k])
        self.pos, self.state = k, "open"
        self._take(k + len(TOOL_CALL_START))
        return events

    def _open(self, final: bool) -> list[StreamEvent] | bool | None:
        tag = self._expect(final, FUNCTION_START)
        if not isinstance(tag, str):
            return tag
        self.state, self.parts, self.parts_chars = "name", [], 0
        return []

    def _read_name(self, final: bool) -> str | bool | None:
        """The name up to `>` (consumed), False when it cannot be one, None while it goes on."""
        end = self.pending.find(">", self.pos)
        stop = len(self.pending) if end < 0 else end
        self.parts_chars += stop - self.pos
        if self.parts_chars > MAX_NAME_CHARS or _NAME_BREAK.search(self.pending, self.pos, stop):
            return False
        self.parts.append(self._take(stop))
        if end < 0:
            return False if final else None
        self._take(end + 1)
        name, self.parts = "".join(self.parts), []
        return name if name else False

    def _name(self, final: bool) -> list[StreamEvent] | bool | None:
        name = self._read_name(final)
        if not isinstance(name, str):
            return name
        self.types = parameter_types(self.parser.schemas, name)
        self.state, self.raw, self.params = "body", [], 0
        index = self.calls
        self.calls += 1
        return [ToolCallDelta(index, name, "")]

    def _args(self, text: str) -> list[StreamEvent]:
        return [ToolCallDelta(self.calls - 1, None, text)] if text else []

    def _body(self, final: bool) -> list[StreamEvent] | bool | None:
        tag = self._expect(final, PARAMETER_START, FUNCTION_END)
        if not isinstance(tag, str):
            return tag
        if tag == FUNCTION_END:
            self.state = "close"
            return self._args("}" if self.params else "{}")
        self.state, self.parts, self.parts_chars = "key", [], 0
        return []

    def _key(self, final: bool) -> list[StreamEvent] | bool | None:
        key = self._read_name(final)
        if not isinstance(key, str):
            return key
        self.value_types = self.types.get(key, set())
        self.state, self.value_started, self.held_newline = "value", False, False
        self.parts, self.parts_chars = [], 0
        lead = ("{" if not self.params else ", ") + json.dumps(key, ensure_ascii=False) + ": "
        self.params += 1
        return self._args(lead + ('"' if is_text(self.value_types) else ""))

    def _value(self, final: bool) -> list[StreamEvent] | bool | None:
        if not self.value_started:
            if self.pos == len(self.pending):
                return False if final else None
            self.value_started = True
            if self.pending.startswith("\n", self.pos):
                self.pos += 1
        end = self.pending.find(PARAMETER_END, self.pos)
        if end < 0:
            if final:
                return False  # a parameter left open
            stop = len(self.pending) - held_prefix(self.pending, PARAMETER_END, self.pos)
            if stop == self.pos:
                return None
            piece, self.pos = self.pending[self.pos : stop], stop
        else:
            piece, self.pos = self.pending[self.pos : end], end + len(PARAMETER_END)
            self.state = "body"
        closed = end >= 0
        if is_text(self.value_types):
            return self._args(self._text_piece(piece, closed))
        self.parts.append(piece)
        if not closed:
            return []
        raw, self.parts = "".join(self.parts), []
        try:
            return self._args(value_json(raw.removesuffix("\n"), self.value_types))
        except NotACall:
            return False

    def _text_piece(self, piece: str, closed: bool) -> str:
        """A string value's next piece, JSON-escaped: its last newline held back until the next
        piece says whether `</parameter>` follows it (then it is dropped)."""
        text = ("\n" if self.held_newline else "") + piece
        self.held_newline = False
        if text.endswith("\n"):
            text = text[:-1]
            self.held_newline = not closed
        return json.dumps(text, ensure_ascii=False)[1:-1] + ('"' if closed else "")

    def _close(self, final: bool) -> list[StreamEvent] | bool | None:
        if final and _NOT_WS.search(self.pending, self.pos) is None:
            self.pos, self.state = len(self.pending), "text"
            return None
        tag = self._expect(final, TOOL_CALL_END)
        if not isinstance(tag, str):
            return tag
        self.state = "text"
        return []

    def _skip(self, final: bool) -> list[StreamEvent] | None:
        """A block found not to be a call after its name went out: dropped up to its end."""
        end = self.pending.find(TOOL_CALL_END, self.pos)
        if end < 0:
            self.pos = len(self.pending) - (0 if final else held_prefix(self.pending, TOOL_CALL_END, self.pos))
            return None
        self.pos, self.state = end + len(TOOL_CALL_END), "text"
        return []
