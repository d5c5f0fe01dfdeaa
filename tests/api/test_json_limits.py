"""The bounds on JSON text: depth counted as the json module nests, without recursion, whatever
the strings hold; text past the bounds a ValueError, never RecursionError."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmserve.api.json_limits import MAX_JSON_DEPTH, JSONLimitError, check_json_limits, json_depth, loads_bounded


def depth_of(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    return 0


# Strings full of what the count must not be fooled by: brackets, quotes, backslashes.
tricky = st.text(alphabet='[]{}"\\ab é\n', max_size=8)
values = st.recursive(
    st.none() | st.integers() | tricky,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tricky, inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(values, st.booleans(), st.sampled_from(["utf-8", "utf-16", "utf-32"]))
def test_depth_is_the_nesting_json_reads(value: Any, ascii: bool, encoding: str) -> None:
    text = json.dumps(value, ensure_ascii=ascii)
    assert json_depth(text) == depth_of(value)
    assert json_depth(text.encode(encoding)) == depth_of(value)  # bodies come as bytes


def test_an_unclosed_string_holds_the_rest_of_the_text() -> None:
    assert json_depth('[["a"], "[[[[') == 2
    assert json_depth('[["a\\"[[[[') == 2
    assert json_depth("[" * 5 + "]" * 5 + ' "') == 5


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_text_past_the_depth_is_a_value_error_never_a_recursion_error(opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    ok = opener * MAX_JSON_DEPTH + "1" + closer * MAX_JSON_DEPTH
    assert depth_of(loads_bounded(ok)) == MAX_JSON_DEPTH
    for n in (MAX_JSON_DEPTH + 1, sys.getrecursionlimit() + 10, 100_000):
        deep = opener * n + "1" + closer * n
        with pytest.raises(JSONLimitError, match=f"nested more than {MAX_JSON_DEPTH} levels deep"):
            loads_bounded(deep)
        with pytest.raises(JSONLimitError):
            loads_bounded(deep.encode())
        with pytest.raises(JSONLimitError):  # unclosed, as a body cut short or an answer is
            loads_bounded(opener * n)
    # Brackets inside strings are text, however many.
    assert loads_bounded(json.dumps(["[" * 100_000])) == ["[" * 100_000]


def test_size_bound() -> None:
    with pytest.raises(JSONLimitError, match="over the limit of 10 characters"):
        check_json_limits('"' + "a" * 10 + '"', max_chars=10)
    check_json_limits('"' + "a" * 10 + '"', max_chars=None)
    with pytest.raises(ValueError):  # not JSON: the json module's own ValueError
        loads_bounded("[1,")
