"""Where the values of a JSON object begin and end in text that may still be arriving: what the
streaming tool-call parsers need to tell a function's name and its arguments apart before the
model has finished writing them. Complete values are checked with the json module (within the
bounds of json_limits); this only
walks the structure (strings with their escapes, nesting depth)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from vlmserve.api.json_limits import loads_bounded

_WS = " \t\n\r"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


class Malformed(Exception):
    """The text cannot be the start of the JSON value expected there."""


def scan_string(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON string starting at text[i] == '"', or None while it is open."""
    j = i + 1
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch == '"':
            return j + 1
        j += 1
    return None


def scan_value(text: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value starting at text[i] (no leading whitespace), or None
    while it is incomplete. A number or literal at the end of the text is incomplete (more digits
    may come). Raises Malformed when text[i] cannot start a value or brackets do not match."""
    ch = text[i]
    if ch == '"':
        return scan_string(text, i)
    if ch in "{[":
        closers = []
        j = i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = scan_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                closers.append("}" if ch == "{" else "]")
            elif ch in "}]":
                if not closers or closers.pop() != ch:
                    raise Malformed
                if not closers:
                    return j + 1
            j += 1
        return None
    if ch in "-0123456789tfn":
        j = i
        while j < len(text) and text[j] not in _WS + ",}]":
            j += 1
        return j if j < len(text) else None
    raise Malformed


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


class ValueEnd:
    """Where a JSON value ends, found as its text grows: each call reads only what arrived since
    the last (a streamed call's arguments are scanned once, not once per delta). The text given
    to each call must extend the text given before."""

    def __init__(self, text: str, start: int) -> None:
        self.start = start
        self.primitive = text[start] not in '{["'
        self.j = start
        self.closers: list[str] = []
        self.in_string = False
        self.end: int | None = None

    def advance(self, text: str) -> int | None:
        """The value's end (exclusive), or None while it is open. Malformed when brackets do not
        match."""
        if self.end is not None:
            return self.end
        j = self.j
        if self.primitive:
            while j < len(text) and text[j] not in _WS + ",}]":
                j += 1
            self.j = j
            if j < len(text):
                self.end = j
            return self.end
        while j < len(text):
            ch = text[j]
            if self.in_string:
                if ch == "\\":
                    if j + 1 >= len(text):
                        break  # the escaped character has not arrived
                    j += 2
                    continue
                if ch == '"':
                    self.in_string = False
                    if not self.closers:  # the value was this string
                        self.end = j + 1
                        return self.end
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.closers.append("}" if ch == "{" else "]")
            elif ch in "}]":
                if not self.closers or self.closers.pop() != ch:
                    raise Malformed
                if not self.closers:
                    self.end = j + 1
                    return self.end
            j += 1
        self.j = j
        return None
