"""The grammar (xgrammar's EBNF) that forces a call in Qwen3.5's tool-call format, for
tool_choice "required" or a named function on a server started with `--tool-call-parser
qwen3_coder`: the answer is one call (or several, one per line, when parallel calls are allowed)
of the offered functions (after the model's reasoning, where the prompt opened it), written as
the published template writes a call,

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

with the function's parameters in the order its schema lists them (the required ones always,
the others optionally, no others), each value of the type the schema gives it (xml_tool_parser.
schema_types): a string is any text without `</parameter>`; an integer, a number, a boolean, null
as JSON writes them; an object or an array any JSON one (as `tojson` writes it); an `enum` or
`const` one of its values."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from vlmserve.api.xml_tool_parser import PARAMETER_END, schema_types

# A string value: text in which `</parameter>` never occurs; the reasoning before forced calls:
# text in which `</think>` never occurs. Each as a right-linear grammar (one rule per state of
# matching the tag; xgrammar matches it in time linear in the text): state k has matched the tag's
# first k characters; `<` (which occurs in these tags only first) restarts at 1.
_TEXT_RULE = "xml_text0"
_THINK_RULE = "think_text0"
THINK_END = "</think>"


def _text_without(tag: str, name: str) -> list[str]:
    """Rules `{name}0` ... of text in which `tag` (whose first character occurs only there) never occurs."""
    assert tag[0] not in tag[1:]
    first = _class_char(tag[0])
    rules = [f'{name}0 ::= "" | [^{first}] {name}0 | {_literal(tag[0])} {name}1']
    for k in range(1, len(tag)):
        after = f"{_literal(tag[k])} {name}{k + 1} | " if k + 1 < len(tag) else ""
        restart = f"{_literal(tag[0])} {name}1"
        rules.append(f'{name}{k} ::= "" | {after}{restart} | [^{first}{_class_char(tag[k])}] {name}0')
    return rules


_JSON_RULES = [
    'json_value ::= json_object | json_array | json_string | json_number | "true" | "false" | "null"',
    'json_object ::= "{" (json_string ": " json_value (", " json_string ": " json_value)*)? "}"',
    'json_array ::= "[" (json_value (", " json_value)*)? "]"',
    'json_string ::= "\\"" ([^"\\\\\\x00-\\x1f] | "\\\\" (["\\\\/bfnrt] | "u" hex hex hex hex))* "\\""',
    "hex ::= [0-9a-fA-F]",
    'json_integer ::= "-"? ("0" | [1-9] [0-9]*)',
    'json_number ::= json_integer ("." [0-9]+)? ([eE] [+\\-]? [0-9]+)?',
]
_TYPE_RULES = {
    "string": _TEXT_RULE,
    "integer": "json_integer",
    "number": "json_number",
    "boolean": '"true" | "false"',
    "null": '"null"',
    "object": "json_object",
    "array": "json_array",
}


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _class_char(ch: str) -> str:
    return "\\" + ch if ch in "]\\^-" else ch


def _value_rule(schema: Any) -> str:
    """The alternatives a parameter's value may take."""
    if isinstance(schema, Mapping):
        values = list(schema["enum"]) if isinstance(schema.get("enum"), list) else []
        values += [schema["const"]] if "const" in schema else []
        if values:
            texts = [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in values]
            texts = [t for t in texts if PARAMETER_END not in t]
            if texts:
                return " | ".join(_literal(t) for t in dict.fromkeys(texts))
    types = schema_types(schema)
    known = [_TYPE_RULES[t] for t in sorted(types) if t in _TYPE_RULES]
    return " | ".join(known) if known else _TEXT_RULE


def _function_rules(index: int, name: str, parameters: Any) -> list[str]:
    properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
    properties = properties if isinstance(properties, Mapping) else {}
    required = parameters.get("required") if isinstance(parameters, Mapping) else None
    required = set(required) if isinstance(required, list) else set()
    rules, parts = [], []
    for k, (key, schema) in enumerate(properties.items()):
        rule = f"f{index}_p{k}"
        value = _value_rule(schema)
        rules.append(f'{rule} ::= {_literal(f"<parameter={key}>" + chr(10))} ({value}) "\\n</parameter>\\n"')
        parts.append(rule if key in required else f"{rule}?")
    body = " ".join([_literal(f"<function={name}>\n"), *parts, '"</function>"'])
    return [f"f{index} ::= {body}", *rules]


def forced_call_grammar(functions: Sequence[tuple[str, Any]], parallel: bool, reasoning: bool = False) -> str:
    """The EBNF grammar of a forced answer calling one of `functions` ((name, parameters schema)),
    or several, one per line, when `parallel`; with `reasoning`, after the model's reasoning (any
    text, then `</think>` and a blank line, as the template closes it): the prompt opened it."""
    calls = "call" + (' ("\\n" call)*' if parallel else "")
    rules = [
        f'root ::= {_THINK_RULE} "{THINK_END}\\n\\n" {calls}' if reasoning else f"root ::= {calls}",
        'call ::= "<tool_call>\\n" (' + " | ".join(f"f{i}" for i in range(len(functions))) + ') "\\n</tool_call>"',
    ]
    for i, (name, parameters) in enumerate(functions):
        rules += _function_rules(i, name, parameters)
    rules += _text_without(PARAMETER_END, _TEXT_RULE[:-1])
    rules += _text_without(THINK_END, _THINK_RULE[:-1]) if reasoning else []
    return "\n".join(rules + _JSON_RULES) + "\n"
