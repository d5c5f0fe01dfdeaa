"""A model's answer read back as OpenAI tool calls, whole or streamed.

Three shapes of answer, one parser each:
- hermes (tool_choice "auto", vLLM's `--tool-call-parser hermes`): the Qwen chat templates ask for
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the text outside them is the
  message's content.
- "required": the answer is forced (structured outputs) to vLLM's JSON array
  `[{"name": ..., "parameters": {...}}, ...]`.
- a named function: the answer is forced to that function's parameters, the one call's arguments.

Each parser gives the whole answer's content and calls (`parse`), and a stream (`stream()`) that
is fed the answer's text deltas and gives content deltas and tool-call deltas: a call's name in its
first delta, then its arguments as string fragments. Fed any split of a valid answer, the stream
gives what `parse` gives (the fragments of a call's arguments join to its `arguments`). A stream's
work per delta is proportional to the delta (it runs on the event loop): it keeps only the text
it holds back, reads each character of a call once as it arrives, and parses a call whole once,
when it ends. A call nested past json_limits' bound is not a call.

`arguments` is the JSON text of the arguments as the model wrote it (valid JSON, checked; not
re-serialised, so that what is streamed is exactly what the whole answer gives).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Protocol

from vlmserve.api.json_limits import MAX_JSON_DEPTH, loads_bounded
from vlmserve.api.json_scan import Malformed, ObjectStream, scan_object, scan_value, skip_ws


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    name: str | None  # set on a call's first delta only
    arguments: str


StreamEvent = ContentDelta | ToolCallDelta


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolStream(Protocol):
    def feed(self, delta: str) -> list[StreamEvent]: ...

    def finish(self) -> list[StreamEvent]: ...


def held_prefix(text: str, tag: str, start: int = 0) -> int:
    """How many characters at the end of `text[start:]` could be the start of `tag` (held back
    until the next delta says whether they are)."""
    for n in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def content_beside_calls(text: str, called: bool, held_space: list[str]) -> list[StreamEvent]:
    """Content text as a tool-call stream sends it: once a call was read, whitespace is held in
    `held_space` (the whole message drops it after the last call) until text follows it."""
    if not called:
        return [ContentDelta(text)] if text else []
    body = text.rstrip()
    if not body:
        held_space.append(text)
        return []
    held = "".join(held_space)
    held_space[:] = [text[len(body) :]]
    return [ContentDelta(held + body)]


def _call_from_object(text: str, name_key: str, args_key: str, max_depth: int = MAX_JSON_DEPTH) -> ToolCall:
    """A complete JSON object {name_key: str, args_key: value} (nothing else around it but
    whitespace) as a call; ValueError when it is not one, or is past the bounds of JSON
    (json_limits: nested deeper than `max_depth`, or too long)."""
    i = skip_ws(text, 0)
    try:
        scan = scan_object(text, i)
    except Malformed:
        raise ValueError("not a JSON object") from None
    if scan.end is None or skip_ws(text, scan.end) != len(text):
        raise ValueError("not one complete JSON object")
    loads_bounded(text, max_depth)  # numbers, literals and escapes checked by the json module
    name = scan.value(text, name_key) if name_key in scan.members else None
    if not isinstance(name, str) or args_key not in scan.members:
        raise ValueError(f"a call needs a string {name_key!r} and {args_key!r}")
    start, end = scan.members[args_key]
    return ToolCall(name, text[start:end])


class _CallProgress:
    """One call being streamed from a JSON object fed in pieces: its name once complete, then its
    arguments' text as it arrives (held until the name is known, when they come first). Each
    piece is read once (ObjectStream)."""

    def __init__(self, index: int, name_key: str, args_key: str, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.index = index
        self.name_key, self.args_key = name_key, args_key
        self.object = ObjectStream((name_key, args_key), max_depth - 1)
        self.name_parts: list[str] = []
        self.name_sent = False
        self.args_parts: list[str] = []  # the arguments so far, while the name is not sent
        self.held_args_done = False
        self.args_done = False  # the arguments have been sent whole
        self.args_sent = 0

    def feed(self, text: str, start: int = 0) -> tuple[list[StreamEvent], int | None]:
        """The events for the next piece of the call's object, text[start:] (leading whitespace
        allowed), and where in `text` the object closed (None: still open)."""
        pieces, end = self.object.feed(text, start)
        events: list[StreamEvent] = []
        args = ""
        for piece in pieces:
            if piece.key == self.name_key and not self.name_sent:
                if piece.first:
                    self.name_parts = []
                self.name_parts.append(piece.text)
                name = self._name("".join(self.name_parts)) if piece.last else None
                if name is not None:
                    self.name_sent = True
                    events.append(ToolCallDelta(self.index, name, ""))
                    args, self.args_done = "".join(self.args_parts), self.held_args_done
            elif piece.key == self.args_key and not self.args_done:
                if self.name_sent:
                    args += piece.text
                    self.args_done = piece.last
                else:  # held; a later arguments member replaces it (as json.loads reads it)
                    if piece.first:
                        self.args_parts = []
                    self.args_parts.append(piece.text)
                    self.held_args_done = piece.last
        if args:
            self.args_sent += len(args)
            events.append(ToolCallDelta(self.index, None, args))
        return events, end

    def _name(self, text: str) -> str | None:
        if not text.startswith('"'):
            return None
        try:
            name = json.loads(text)
        except ValueError:
            return None
        return name if isinstance(name, str) else None

    def complete(self, call: ToolCall) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if not self.name_sent:
            self.name_sent = True
            events.append(ToolCallDelta(self.index, call.name, ""))
        if len(call.arguments) > self.args_sent:
            events.append(ToolCallDelta(self.index, None, call.arguments[self.args_sent :]))
            self.args_sent = len(call.arguments)
        return events


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks (vLLM's hermes parser).
    A block left open at the end of the answer is read to the end. If any block is not a valid
    call, the answer has no calls: all of it is content (as vLLM)."""

    START = "<tool_call>"
    END = "</tool_call>"

    def parse(self, text: str) -> ParsedOutput:
        before: list[str] = []
        after: list[str] = []
        calls: list[ToolCall] = []
        i = 0
        while True:
            k = text.find(self.START, i)
            if k < 0:
                (after if calls else before).append(text[i:])
                break
            (after if calls else before).append(text[i:k])
            e = text.find(self.END, k)
            block = text[k + len(self.START) : len(text) if e < 0 else e]
            try:
                calls.append(_call_from_object(block, "name", "arguments"))
            except ValueError:
                return ParsedOutput(text, [])
            if e < 0:
                break
            i = e + len(self.END)
        return _with_content("".join(before), "".join(after), calls)

    def stream(self) -> HermesToolStream:
        return HermesToolStream(self)


def _with_content(before: str, after: str, calls: list[ToolCall]) -> ParsedOutput:
    """The content of an answer with calls: the text before the first, and any text after it,
    trailing whitespace dropped; null when blank. Without calls: the whole text."""
    if not calls:
        return ParsedOutput(before, [])
    content = before + after.rstrip()
    return ParsedOutput(content if content.strip() else None, calls)


class HermesToolStream:
    """HermesToolParser fed text deltas. Text outside blocks streams as content (a possible start
    of `<tool_call>` held back until the next delta), except that whitespace after a call is held
    until text follows it (the whole answer drops trailing whitespace).

    NOTE: the work per delta is proportional to the delta: only the text not yet consumed is
    kept (at most a tag's length held back, plus the delta), a block's object is read piece by
    piece as it arrives (ObjectStream), and a block is parsed whole once, when it closes."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self.pending = ""  # text not yet consumed
        self.call: _CallProgress | None = None  # the open block's call
        self.block: list[str] = []  # the open block's text so far
        self.calls = 0
        self.held_space: list[str] = []  # whitespace after a call, not yet sent
        self.failed = False

    def feed(self, delta: str) -> list[StreamEvent]:
        self.pending += delta
        return self._advance(final=False)

    def finish(self) -> list[StreamEvent]:
        events = self._advance(final=True)
        self.held_space = []
        return events

    def _content(self, text: str) -> list[StreamEvent]:
        return content_beside_calls(text, bool(self.calls), self.held_space)

    def _advance(self, final: bool) -> list[StreamEvent]:
        start_tag, end_tag = self.parser.START, self.parser.END
        text, i = self.pending, 0
        events: list[StreamEvent] = []
        while True:
            if self.call is None:
                k = -1 if self.failed else text.find(start_tag, i)
                if k < 0:
                    end = len(text) if final else len(text) - held_prefix(text, start_tag, i)
                    events += self._content(text[i:end])
                    self.pending = text[end:]
                    return events
                events += self._content(text[i:k])
                i = k + len(start_tag)
                self.call, self.block = _CallProgress(self.calls, "name", "arguments"), []
                continue
            e = text.find(end_tag, i)
            if e < 0 and not final:
                end = len(text) - held_prefix(text, end_tag, i)
                visible = text[i:end]
                self.block.append(visible)
                events += self.call.feed(visible)[0]
                self.pending = text[end:]
                return events
            self.block.append(text[i : len(text) if e < 0 else e])
            block = "".join(self.block)
            try:
                events += self.call.complete(_call_from_object(block, "name", "arguments"))
                self.calls += 1
            except ValueError:
                # Not a call after all: what is not yet sent goes out as content, and no later
                # block is read (the whole answer would have no calls; a stream cannot take back).
                self.failed = True
                if not self.call.name_sent:
                    raw = start_tag + block + (end_tag if e >= 0 else "")
                    events += self._content(raw)
            self.call, self.block = None, []
            if e < 0:
                self.pending = ""
                return events
            i = e + len(end_tag)


class RequiredToolParser:
    """tool_choice "required": the answer is forced to `[{"name": ..., "parameters": {...}}, ...]`
    (vLLM's schema); no content."""

    def parse(self, text: str) -> ParsedOutput:
        try:
            items = loads_bounded(text)
        except ValueError:
            return ParsedOutput(text, [])
        if not isinstance(items, list):
            return ParsedOutput(text, [])
        calls = []
        i = skip_ws(text, 0) + 1
        for _ in items:
            i = skip_ws(text, i)
            end = scan_value(text, i)
            assert end is not None  # json.loads read it whole
            try:
                calls.append(_call_from_object(text[i:end], "name", "parameters"))
            except ValueError:
                return ParsedOutput(text, [])
            i = skip_ws(text, end) + 1  # past the comma or the closing bracket
        return ParsedOutput(None, calls)

    def stream(self) -> RequiredToolStream:
        return RequiredToolStream()


class RequiredToolStream:
    """RequiredToolParser fed text deltas: the array's elements read piece by piece as they
    arrive (each character once), a call's name and arguments streamed as its element goes."""

    def __init__(self) -> None:
        self.opened = False  # the array's `[` has come
        self.comma = False  # a comma has come since the last element
        self.call: _CallProgress | None = None  # the open element's call
        self.element: list[str] = []  # the open element's text so far
        self.calls = 0
        self.done = False

    def feed(self, delta: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        i = 0
        while not self.done and i < len(delta):
            if self.call is None:
                i = skip_ws(delta, i)
                if i >= len(delta):
                    break
                ch = delta[i]
                if not self.opened:
                    self.opened, self.done = ch == "[", ch != "["
                elif ch == "," and not self.comma:
                    self.comma = True
                elif ch == "{":
                    # The array is one level: an element nests one level less than the answer.
                    self.call, self.element = _CallProgress(self.calls, "name", "parameters", MAX_JSON_DEPTH - 1), []
                    continue
                else:
                    self.done = True
                i += 1
                continue
            new, end = self.call.feed(delta, i)
            events += new
            if self.call.object.malformed:
                self.done = True
                break
            self.element.append(delta[i : len(delta) if end is None else end])
            if end is None:
                break
            i = end
            try:
                call = _call_from_object("".join(self.element), "name", "parameters", MAX_JSON_DEPTH - 1)
            except ValueError:
                self.done = True
                break
            events += self.call.complete(call)
            self.calls += 1
            self.call, self.comma = None, False
        return events

    def finish(self) -> list[StreamEvent]:
        return []


class NamedToolParser:
    """A named function: the whole answer (forced to its parameters) is the call's arguments;
    an answer cut short before they are whole (max_tokens) is content, not a call."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str) -> ParsedOutput:
        try:
            loads_bounded(text)
        except ValueError:
            return ParsedOutput(text, [])
        return ParsedOutput(None, [ToolCall(self.name, text)])

    def stream(self) -> NamedToolStream:
        return NamedToolStream(self.name)


class NamedToolStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, delta: str) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if not self.started:
            self.started = True
            events.append(ToolCallDelta(0, self.name, ""))
        if delta:
            events.append(ToolCallDelta(0, None, delta))
        return events

    def finish(self) -> list[StreamEvent]:
        return [] if self.started else [ToolCallDelta(0, self.name, "")]
