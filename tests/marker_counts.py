"""A pytest plugin for tests/test_docs_code.py: after collection, print how many tests each of the
selections in $VLMSERVE_SELECTIONS picks ([[path or "", marker expression], ...], as README's
`pytest -q [PATH] -m EXPR` commands give them), so one collection checks every such command.

A marker expression here is Python's boolean syntax over marker names (`not slow and not
server`), which is what pytest's -m grammar is for these words."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest


class _Markers(dict[str, bool]):
    def __missing__(self, name: str) -> bool:
        return False


def _selected(item: pytest.Item, path: str, expression: str) -> bool:
    if path and not item.nodeid.startswith(path.rstrip("/") + "/"):
        return False
    if not expression:
        return True
    markers = _Markers({marker.name: True for marker in item.iter_markers()})
    return bool(eval(expression, {"__builtins__": {}}, markers))


def pytest_collection_finish(session: pytest.Session) -> None:
    selections: list[Any] = json.loads(os.environ.get("VLMSERVE_SELECTIONS", "[]"))
    counts = [sum(_selected(item, path, expr) for item in session.items) for path, expr in selections]
    print("SELECTION-COUNTS " + json.dumps({"all": len(session.items), "counts": counts}))
