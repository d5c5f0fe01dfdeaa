"""The grammar that forces calls in Qwen3.5's format (tool_choice "required" or a named function
on a qwen3_coder server): it admits the calls Qwen3.5's published template writes, refuses
other functions, other parameters, values of other types and other formats, and everything it
admits is read back by the qwen3_coder parser as calls of the offered tools with values of the
types their schemas give."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers
import xgrammar

from vlmserve.api.xml_tool_grammar import forced_call_grammar
from vlmserve.api.xml_tool_parser import XmlToolParser

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "scale": {"type": "number"},
        "hot": {"type": "boolean"},
        "where": {"type": "object"},
        "note": {"type": ["string", "null"]},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city"],
}
FUNCTIONS = [("get_weather", WEATHER), ("get_time", {"type": "object", "properties": {}})]
STOP = 0  # byte 0 stands for the end of the answer


@pytest.fixture(scope="module")
def compiler() -> xgrammar.GrammarCompiler:
    """A vocabulary of the 256 bytes: the grammar's text as it is, byte by byte."""
    info = xgrammar.TokenizerInfo([bytes([b]) for b in range(256)], xgrammar.VocabType.RAW, stop_token_ids=[STOP])
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def admits(grammar: xgrammar.CompiledGrammar, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(grammar)
    return all(matcher.accept_token(b) for b in text.encode()) and matcher.accept_token(STOP)


def call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_it_admits_what_the_published_template_writes(compiler: xgrammar.GrammarCompiler, tiny35_dir: Path) -> None:
    arguments = {"city": "Paris </para", "days": -3, "scale": 2.5, "hot": True, "where": {"a": [1, "b"]}, "note": None}
    calls = [
        {"type": "function", "function": {"name": "get_weather", "arguments": arguments}},
        {"type": "function", "function": {"name": "get_time", "arguments": {}}},
    ]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny35_dir))
    rendered = tokenizer.apply_chat_template(history, tokenize=False)
    answer = rendered.split("</think>\n\n", 1)[1].removesuffix("<|im_end|>\n")
    # The template writes Python's True and None; the grammar has the model write JSON's.
    answer = answer.replace("\nTrue\n", "\ntrue\n").replace("\nNone\n", "\nnull\n")
    grammar = compiler.compile_grammar(forced_call_grammar(FUNCTIONS, parallel=True))
    assert admits(grammar, answer), answer
    assert [json.loads(c.arguments) for c in XmlToolParser(dict(FUNCTIONS)).parse(answer).tool_calls] == [
        arguments,
        {},
    ]
    single = compiler.compile_grammar(forced_call_grammar(FUNCTIONS, parallel=False))
    first, second = answer.split("\n<tool_call>")
    assert admits(single, first) and not admits(single, answer)
    assert admits(single, "<tool_call>" + second)


@pytest.mark.parametrize(
    "text",
    [
        call("get_weather"),  # city is required
        call("get_whether", ("city", "Paris")),
        call("get_weather", ("city", "Paris"), ("wind", "3")),
        call("get_weather", ("city", "Paris"), ("days", "3.5")),
        call("get_weather", ("city", "Paris"), ("hot", "True")),
        call("get_weather", ("city", "Paris"), ("unit", "K")),
        call("get_weather", ("city", "Paris"), ("where", "[1]")),
        call("get_weather", ("days", "3"), ("city", "Paris")),  # the schema's order
        call("get_weather", ("city", "a </parameter> b")),
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # hermes
        "Sure. " + call("get_time"),
        "",
    ],
)
def test_it_refuses_other_calls(compiler: xgrammar.GrammarCompiler, text: str) -> None:
    grammar = compiler.compile_grammar(forced_call_grammar(FUNCTIONS, parallel=True))
    assert not admits(grammar, text)


def test_a_named_function_is_the_only_one(compiler: xgrammar.GrammarCompiler) -> None:
    grammar = compiler.compile_grammar(forced_call_grammar(FUNCTIONS[1:], parallel=False))
    assert admits(grammar, call("get_time"))
    assert not admits(grammar, call("get_weather", ("city", "Paris")))


def random_answer(grammar: xgrammar.CompiledGrammar, rng: random.Random, max_bytes: int = 400) -> str | None:
    """A walk through what the grammar admits, a random allowed byte at a time (None: it ran long)."""
    matcher = xgrammar.GrammarMatcher(grammar)
    bitmask = xgrammar.allocate_token_bitmask(1, 256)
    ids = torch.arange(256)
    out = bytearray()
    while len(out) < max_bytes:
        matcher.fill_next_token_bitmask(bitmask)
        allowed = ids[(bitmask[0][ids // 32] >> (ids % 32)) & 1 == 1].tolist()
        # Mostly printable ASCII and newlines (other bytes may start UTF-8 that never completes).
        choices = [b for b in allowed if 32 <= b < 127 or b == 10] or allowed
        if STOP in allowed and rng.random() < 0.5:
            return out.decode()
        b = rng.choice([c for c in choices if c != STOP] or [STOP])
        if b == STOP:
            return out.decode()
        assert matcher.accept_token(b)
        out.append(b)
    return None


def test_everything_it_admits_is_read_back_as_calls_of_their_types(compiler: xgrammar.GrammarCompiler) -> None:
    grammar = compiler.compile_grammar(forced_call_grammar(FUNCTIONS, parallel=True))
    parser = XmlToolParser(dict(FUNCTIONS))
    rng = random.Random(0)
    types = {"days": int, "scale": (int, float), "hot": bool, "where": dict, "city": str, "unit": str}
    read = 0
    for _ in range(150):
        answer = random_answer(grammar, rng)
        if answer is None:
            continue
        parsed = parser.parse(answer)
        assert parsed.content is None and parsed.tool_calls, answer
        for c in parsed.tool_calls:
            arguments = json.loads(c.arguments)
            assert c.name in ("get_weather", "get_time")
            if c.name == "get_weather":
                assert "city" in arguments
                for key, value in arguments.items():
                    assert key in WEATHER["properties"]
                    assert isinstance(value, types.get(key, (str, type(None)))), (key, value)
                    assert key != "hot" or isinstance(value, bool)
        read += 1
    assert read > 50


def test_with_reasoning_the_calls_come_after_it(compiler: xgrammar.GrammarCompiler) -> None:
    grammar = compiler.compile_grammar(forced_call_grammar(FUNCTIONS, parallel=False, reasoning=True))
    for reasoning in ("", "Let me see: <b> and </thin\nk.\n"):
        assert admits(grammar, reasoning + "</think>\n\n" + call("get_time"))
    assert not admits(grammar, call("get_time"))  # the prompt opened the reasoning: it closes first
    assert not admits(grammar, "a</think>b</think>\n\n" + call("get_time"))
    assert not admits(grammar, "a</think>\n\nSure. " + call("get_time"))
