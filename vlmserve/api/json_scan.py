"""Where the values of a JSON object begin and end in text that may still be arriving: what the
tool-call parsers need to tell a function's name and its arguments apart before the model has
finished writing them. Complete values are checked with the json module (within the bounds of
json_limits); this only walks the structure (strings with their escapes, nesting depth).

scan_object reads a whole text; the streams read pieces as they arrive (ObjectStream, ValueScan),
each character once, so that a stream costs what its text costs whatever the pieces."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field

from vlmserve.api.json_limits import MAX_JSON_DEPTH, loads_bounded

_WS = " \t\n\r"
_VALUE_START = '"{[-0123456789tfn'
# What ends a run of characters a scan can skip: inside a string, a quote or an escape; inside an
# array or object, a string or a bracket; a number or literal, its end; between members, anything
# but whitespace.
_STRING_STOP = re.compile(r'["\\]')
_CONTAINER_STOP = re.compile(r'["\[\]{}]')
_PRIMITIVE_END = re.compile(r"[ \t\n\r,}\]]")
_NOT_WS = re.compile(r"[^ \t\n\r]")


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


class Malformed(Exception):
    """The text cannot be the start of the JSON value expected there."""


def scan_string(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON string starting at text[i] == '"', or None while it is open."""
    j = i + 1
    while True:
        m = _STRING_STOP.search(text, j)
        if m is None:
            return None
        if m.group() == '"':
            return m.end()
        j = m.end() + 1  # past the escaped character


def scan_value(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value starting at text[i] (no leading whitespace), or None
    while it is incomplete. A number or literal at the end of the text is incomplete (more digits
    may come). Raises Malformed when text[i] cannot start a value or brackets do not match."""
    if text[i] not in _VALUE_START:
        raise Malformed
    return ValueScan(text[i], max_depth=sys.maxsize).feed(text, i)


@dataclass
class ObjectScan:
    """A JSON object's members as far as the text goes: key -> (value start, value end or None
    while the value is still open). `end`: the end of the whole object once it is closed."""

    members: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None

    def value(self, text: str, key: str) -> object:
        """The complete value of `key` (KeyError when absent or not complete)."""
        start, end = self.members[key]
        if end is None:
            raise KeyError(key)
        return loads_bounded(text[start:end])


def scan_object(text: str, i: int) -> ObjectScan:
    """The members of the JSON object starting at text[i] == '{', as far as the text goes.
    Raises Malformed when the text cannot be such an object."""
    scan = ObjectScan()
    if i >= len(text):
        return scan
    if text[i] != "{":
        raise Malformed
    i = skip_ws(text, i + 1)
    if i < len(text) and text[i] == "}":
        scan.end = i + 1
        return scan
    while i < len(text):
        if text[i] != '"':
            raise Malformed
        key_end = scan_string(text, i)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            raise Malformed from None
        i = skip_ws(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            raise Malformed
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return scan
        value_end = scan_value(text, i)
        scan.members[key] = (i, value_end)
        if value_end is None:
            return scan
        i = skip_ws(text, value_end)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            raise Malformed
        i = skip_ws(text, i + 1)
    return scan


class ValueScan:
    """Where a JSON value ends, found as its text arrives in pieces: each piece is read once, from
    where the last one stopped (what a streamed call's arguments need, however long they grow).
    Nesting deeper than `max_depth` is Malformed, as are brackets that do not match; anything
    else (numbers, literals, commas) is left for the json module to check once the value is whole."""

    def __init__(self, first: str, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.primitive = first not in '{["'
        self.max_depth = max_depth
        self.closers: list[str] = []
        self.in_string = False
        self.escaped = False  # the piece ended just after a backslash inside a string

    def feed(self, text: str, i: int = 0) -> int | None:
        """The value's end in `text` (exclusive), read from text[i] on, or None when all of the
        piece belongs to it. The first piece starts with the value's first character."""
        if self.primitive:
            m = _PRIMITIVE_END.search(text, i)
            return m.start() if m else None
        n = len(text)
        while i < n:
            if self.in_string:
                if self.escaped:
                    self.escaped, i = False, i + 1
                    continue
                m = _STRING_STOP.search(text, i)
                if m is None:
                    return None
                j = m.start()
                if text[j] == "\\":
                    self.escaped, i = True, j + 1
                    continue
                self.in_string, i = False, j + 1
                if not self.closers:  # the value was this string
                    return i
                continue
            m = _CONTAINER_STOP.search(text, i)
            if m is None:
                return None
            j, ch = m.start(), m.group()
            i = j + 1
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.closers.append("}" if ch == "{" else "]")
                if len(self.closers) > self.max_depth:
                    raise Malformed("nested too deeply")
            elif not self.closers or self.closers.pop() != ch:
                raise Malformed("brackets do not match")
            elif not self.closers:
                return i
        return None


@dataclass(frozen=True)
class MemberText:
    """A piece of the value of a member an ObjectStream watches: `first` on the piece its value
    starts with, `last` on the one it ends with (a piece may be both, and may be empty)."""

    key: str
    text: str
    first: bool
    last: bool


# ObjectStream's states: where in the object the next character falls.
_OPEN, _FIRST_KEY, _KEY, _IN_KEY, _COLON, _VALUE, _IN_VALUE, _AFTER_VALUE, _CLOSED, _MALFORMED = range(10)


class ObjectStream:
    """The members of a JSON object (text that may start with whitespace) read as its text
    arrives, each character once: feed() gives the pieces of the values of the keys in `watch`
    and where in the piece the object closed. Values nest at most `max_depth` levels below the
    object. Text that cannot begin such an object, or nests deeper, stops the stream
    (`malformed`); what it has read stays as it was."""

    def __init__(self, watch: tuple[str, ...], max_depth: int = MAX_JSON_DEPTH - 1) -> None:
        self.watch = watch
        self.max_depth = max_depth
        self.state = _OPEN
        self.key_parts: list[str] = []
        self.key_escaped = False
        self.key = ""
        self.value: ValueScan | None = None
        self.value_started = False

    @property
    def malformed(self) -> bool:
        return self.state == _MALFORMED

    def feed(self, text: str, start: int = 0) -> tuple[list[MemberText], int | None]:
        """(the watched values' pieces in text[start:], the index in `text` just past the
        object's closing brace, or None when it is still open)."""
        pieces: list[MemberText] = []
        i, n = start, len(text)
        while i < n and self.state not in (_CLOSED, _MALFORMED):
            if self.state == _IN_KEY:
                i = self._key(text, i)
                continue
            if self.state == _IN_VALUE:
                i = self._value(text, i, pieces)
                continue
            m = _NOT_WS.search(text, i)
            if m is None:
                break
            i, ch = m.start(), m.group()
            state = self.state
            if state == _OPEN and ch == "{":
                self.state = _FIRST_KEY
            elif state in (_FIRST_KEY, _KEY) and ch == '"':
                self.state, self.key_parts = _IN_KEY, []
            elif state in (_FIRST_KEY, _AFTER_VALUE) and ch == "}":
                self.state = _CLOSED
                return pieces, i + 1
            elif state == _COLON and ch == ":":
                self.state = _VALUE
            elif state == _VALUE and ch in _VALUE_START:
                self.state, self.value, self.value_started = _IN_VALUE, ValueScan(ch, self.max_depth), False
                continue  # the value scan reads its first character
            elif state == _AFTER_VALUE and ch == ",":
                self.state = _KEY
            else:
                self.state = _MALFORMED
                break
            i += 1
        return pieces, None

    def _key(self, text: str, i: int) -> int:
        """Reads the key from text[i] (inside its quotes) to its end or the end of the piece."""
        while i < len(text):
            if self.key_escaped:
                self.key_escaped = False
                self.key_parts.append(text[i])
                i += 1
                continue
            m = _STRING_STOP.search(text, i)
            if m is None:
                self.key_parts.append(text[i:])
                return len(text)
            j = m.start()
            self.key_parts.append(text[i : j + 1])
            i = j + 1
            if text[j] == "\\":
                self.key_escaped = True
                continue
            try:
                self.key = json.loads('"' + "".join(self.key_parts))
            except ValueError:
                self.state = _MALFORMED
                return len(text)
            self.state = _COLON
            return i
        return i

    def _value(self, text: str, i: int, pieces: list[MemberText]) -> int:
        """Reads the member's value from text[i] to its end or the end of the piece."""
        assert self.value is not None
        try:
            end = self.value.feed(text, i)
        except Malformed:
            self.state = _MALFORMED
            return len(text)
        stop = len(text) if end is None else end
        if self.key in self.watch:
            pieces.append(MemberText(self.key, text[i:stop], not self.value_started, end is not None))
        self.value_started = True
        if end is None:
            return stop
        self.state, self.value = _AFTER_VALUE, None
        return end
