"""The bounds on every JSON text the API process reads: request bodies, JSON sent inside them as
text (a history's tool-call arguments, a structured-output schema), and the tool calls a model
writes. The json module's decoder recurses once per level of nesting, so text nested about a
thousand levels deep (fewer the deeper the caller's stack) raises RecursionError instead of a
ValueError; and the code that walks what it parsed (templates, validators, schema compilers)
recurses again. Depth is therefore counted here first, without recursion, and text past the
bounds is refused with a ValueError before anything parses it.

NOTE: the depth is that of brackets outside strings, counted as the json module would lex them
(a string's brackets and escaped quotes do not count; an unclosed string runs to the end). It
costs a few C passes over the text, and for a text with more than MAX_JSON_DEPTH brackets outside
its strings one more walk over those brackets (about 20 ns each, less than json.loads spends on
them)."""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

# serde_json's default recursion limit. A request body nests about 5 levels before a schema or
# a value of its own begins; a JSON schema in practice nests a few levels per level of its data.
MAX_JSON_DEPTH = 128
# A JSON text inside a request (it is part of the body, so within --max-body-bytes too) or one
# tool call in an answer: far past any prompt or answer a model handles.
MAX_JSON_CHARS = 16 * 1024 * 1024

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
for _open in b"[{":
    _STEP[_open] = 1
for _close in b"]}":
    _STEP[_close] = -1


class JSONLimitError(ValueError):
    """A JSON text past the depth or size bound (its message completes "<what> ...")."""


def _opens(text: str | bytes) -> int:
    if isinstance(text, str):
        return text.count("[") + text.count("{")
    return text.count(b"[") + text.count(b"{")


def json_depth(text: str | bytes) -> int:
    """How deep the text's arrays and objects nest (0 for a bare value), counted without
    recursion. Text that is not JSON is counted as far as its brackets go."""
    if isinstance(text, bytes) and not json.detect_encoding(text).startswith("utf-8"):
        text = text.decode(json.detect_encoding(text), "replace")  # UTF-16 or 32, as json.loads reads it
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    outside = _STRING.sub(b"", data)
    # A quote left is one no later quote closes: the rest of the text is inside that string.
    quote = outside.find(b'"')
    brackets = (outside if quote < 0 else outside[:quote]).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def check_json_limits(
    text: str | bytes, max_depth: int = MAX_JSON_DEPTH, max_chars: int | None = MAX_JSON_CHARS
) -> None:
    """JSONLimitError when `text` is longer than `max_chars` (None: no bound here; a request body
    has its own) or nests deeper than `max_depth`."""
    if max_chars is not None and len(text) > max_chars:
        raise JSONLimitError(f"is over the limit of {max_chars} characters of JSON")
    if _opens(text) <= max_depth:  # the common case: too few brackets to be too deep
        return
    if json_depth(text) > max_depth:
        raise JSONLimitError(f"is nested more than {max_depth} levels deep (the limit for JSON)")


def loads_bounded(text: str | bytes, max_depth: int = MAX_JSON_DEPTH, max_chars: int | None = MAX_JSON_CHARS) -> Any:
    """json.loads within the bounds: ValueError for text that is not JSON, JSONLimitError (a
    ValueError) for text past them, never RecursionError."""
    check_json_limits(text, max_depth, max_chars)
    return json.loads(text)
