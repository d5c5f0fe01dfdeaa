"""The package's shape, checked: no import cycle between any two modules (imports inside
functions counted), and no code in the engine or the server that names a model family. The layer
contracts themselves are pyproject.toml's [tool.importlinter], run by `lint-imports`."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import grimp

PACKAGE = Path(__file__).resolve().parent.parent / "vlmserve"
FAMILY_WORD = re.compile(r"qwen", re.IGNORECASE)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph.find_modules_directly_imported_by(module):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycle_between_modules() -> None:
    graph = grimp.build_graph("vlmserve")
    assert graph.find_modules_directly_imported_by("vlmserve.families.qwen_vl.tokenizer")  # the graph is real
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for module in ("p.a", "p.b", "p.c"):
        graph.add_module(module)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def _code_tokens(source: str) -> list[tokenize.TokenInfo]:
    """Names and strings of the code: comments and docstrings (a string statement) left out."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    kept = []
    for i, tok in enumerate(tokens):
        if tok.type not in (tokenize.NAME, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)):
            continue
        if tok.type == tokenize.STRING:
            before = next((t for t in reversed(tokens[:i]) if t.type not in (tokenize.NL, tokenize.COMMENT)), None)
            after = tokens[i + 1] if i + 1 < len(tokens) else None
            starts_statement = before is None or before.type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
            if starts_statement and after is not None and after.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                continue  # a docstring
        kept.append(tok)
    return kept


def test_engine_and_server_code_names_no_family() -> None:
    offenders = []
    for folder in ("engine", "api", "ipc"):
        for path in sorted((PACKAGE / folder).glob("*.py")):
            for tok in _code_tokens(path.read_text(encoding="utf-8")):
                if FAMILY_WORD.search(tok.string):
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{tok.start[0]}: {tok.string[:60]}")
    assert offenders == []


def test_the_family_name_check_sees_code_but_not_docstrings() -> None:
    source = (
        '"""About Qwen2-VL."""\n\nx = 1  # Qwen-VL-Chat\ny = "qwen"\nif isinstance(p, QwenVLProcessor):\n    pass\n'
    )
    named = [t.string for t in _code_tokens(source) if FAMILY_WORD.search(t.string)]
    assert named == ['"qwen"', "QwenVLProcessor"]
