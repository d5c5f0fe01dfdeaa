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
gives what `parse` gives (the fragments of a call's arguments join to its `arguments`).

`arguments` is the JSON text of the arguments as the model wrote it (valid JSON, checked; not
re-serialised, so that what is streamed is exactly what the whole answer gives).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Protocol

from vlmserve.api.json_limits import MAX_JSON_DEPTH, loads_bounded
from vlmserve.api.json_scan import Malformed, ValueEnd, scan_object, scan_value, skip_ws


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


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (held back until
    the next delta says whether they are)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


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
    """One call being streamed from a JSON object: its name once complete, then its arguments'
    text as far as it goes. Once the arguments have begun, only the new text is scanned."""

    def __init__(self, index: int, name_key: str, args_key: str) -> None:
        self.index = index
        self.name_key, self.args_key = name_key, args_key
        self.name_sent = False
        self.args_sent = 0
        self.args: ValueEnd | None = None

    def progress(self, text: str) -> list[StreamEvent]:
        """`text`: the call's object so far (leading whitespace allowed), a prefix of its final text."""
        events: list[StreamEvent] = []
        if self.args is None:
            try:
                scan = scan_object(text, skip_ws(text, 0))
            except Malformed:
                return events
            if not self.name_sent:
                try:
                    name = scan.value(text, self.name_key)
                except (KeyError, ValueError):
                    return events
                if not isinstance(name, str):
                    return events
                self.name_sent = True
                events.append(ToolCallDelta(self.index, name, ""))
            if self.args_key not in scan.members:
                return events
            self.args = ValueEnd(text, scan.members[self.args_key][0])
        try:
            end = self.args.advance(text)
        except Malformed:
            return events
        # An open value's text so far is all part of it.
        fragment = text[self.args.start + self.args_sent : len(text) if end is None else end]
        if fragment:
            self.args_sent += len(fragment)
            events.append(ToolCallDelta(self.index, None, fragment))
        return events

    @property
    def args_open(self) -> bool:
        return self.args is not None and self.args.end is None

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
    until text follows it (the whole answer drops trailing whitespace)."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.pos = 0  # what is consumed of self.text
        self.call: _CallProgress | None = None  # the open block's call
        self.calls = 0
        self.held_space = ""  # whitespace after a call, not yet sent
        self.failed = False
        self.searched = 0  # the open block holds no end tag before this

    def feed(self, delta: str) -> list[StreamEvent]:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> list[StreamEvent]:
        events = self._advance(final=True)
        self.held_space = ""
        return events

    def _content(self, text: str) -> list[StreamEvent]:
        if not self.calls:
            return [ContentDelta(text)] if text else []
        body = text.rstrip()
        if not body:
            self.held_space += text
            return []
        body, self.held_space = self.held_space + body, text[len(body) :]
        return [ContentDelta(body)]

    def _advance(self, final: bool) -> list[StreamEvent]:
        start_tag, end_tag = self.parser.START, self.parser.END
        events: list[StreamEvent] = []
        while True:
            if self.call is None:
                k = -1 if self.failed else self.text.find(start_tag, self.pos)
                if k < 0:
                    end = len(self.text) if final else len(self.text) - held_prefix(self.text[self.pos :], start_tag)
                    events += self._content(self.text[self.pos : end])
                    self.pos = end
                    return events
                events += self._content(self.text[self.pos : k])
                self.pos = k + len(start_tag)
                self.call = _CallProgress(self.calls, "name", "arguments")
                continue
            e = self.text.find(end_tag, max(self.pos, self.searched))
            if e < 0 and not final:
                self.searched = max(self.pos, len(self.text) - len(end_tag) + 1)
                visible = self.text[self.pos : len(self.text) - held_prefix(self.text[self.pos :], end_tag)]
                events += self.call.progress(visible)
                return events
            block = self.text[self.pos : len(self.text) if e < 0 else e]
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
            self.call = None
            self.pos = len(self.text) if e < 0 else e + len(end_tag)
            if e < 0:
                return events


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
    def __init__(self) -> None:
        self.text = ""
        self.element_start: int | None = None  # where the open element begins
        self.next_at = 0  # where to look for the next element
        self.opened = False
        self.call: _CallProgress | None = None
        self.calls = 0
        self.done = False

    def feed(self, delta: str) -> list[StreamEvent]:
        self.text += delta
        events: list[StreamEvent] = []
        text = self.text
        while not self.done:
            if not self.opened:
                i = skip_ws(text, 0)
                if i >= len(text):
                    return events
                if text[i] != "[":
                    self.done = True
                    return events
                self.opened, self.next_at = True, i + 1
            if self.call is None:
                i = skip_ws(text, self.next_at)
                if i < len(text) and text[i] == ",":
                    i = skip_ws(text, i + 1)
                if i >= len(text):
                    return events
                if text[i] != "{":
                    self.done = True
                    return events
                self.element_start = i
                self.call = _CallProgress(self.calls, "name", "parameters")
            assert self.element_start is not None
            element = text[self.element_start :]
            if self.call.args_open:  # the parameters are still arriving: no need to scan the rest
                events += self.call.progress(element)
                if self.call.args_open:
                    return events
            try:
                scan = scan_object(element, 0)
            except Malformed:
                self.done = True
                return events
            if scan.end is None:
                events += self.call.progress(element)
                return events
            try:
                # The array is one level: an element nests one level less than the answer.
                call = _call_from_object(element[: scan.end], "name", "parameters", MAX_JSON_DEPTH - 1)
                events += self.call.complete(call)
            except ValueError:
                self.done = True
                return events
            self.calls += 1
            self.call = None
            self.next_at = self.element_start + scan.end
        return events

    def finish(self) -> list[StreamEvent]:
        return []


class NamedToolParser:
    """A named function: the whole answer (forced to its parameters) is the call's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str) -> ParsedOutput:
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
