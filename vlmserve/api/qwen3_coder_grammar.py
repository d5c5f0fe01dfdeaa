"""The grammar (xgrammar's EBNF) that forces a call in Qwen3.5's tool-call format, for
tool_choice "required" or a named function on a server started with `--tool-call-parser
qwen3_coder`: the answer is one call (or several, one per line, when parallel calls are allowed)
of the offered functions, written as the published template writes a call,

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

with the function's parameters in the order its schema lists them (the required ones always,
the others optionally, no others), each value of the type the schema gives it (qwen3_coder_tools.
schema_types): a string is any text without `</parameter>`; an integer, a number, a boolean, null
as JSON writes them; an object or an array any JSON one (as `tojson` writes it); an `enum` or
`const` one of its values."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from vlmserve.api.qwen3_coder_tools import PARAMETER_END, schema_types

# A string value: text in which `</parameter>` never occurs, as a right-linear grammar (one rule
# per state of matching the tag; xgrammar matches it in time linear in the text). State k has
# matched the tag's first k characters; `<` (which occurs in the tag only first) restarts at 1.
_TEXT_RULE = "xml_text0"


def _text_rules() -> list[str]:
    tag = PARAMETER_END
    rules = [f'{_TEXT_RULE} ::= "" | [^<] {_TEXT_RULE} | "<" xml_text1']
    for k in range(1, len(tag)):
        after = f"{_literal(tag[k])} xml_text{k + 1} | " if k + 1 < len(tag) else ""
        rules.append(f'xml_text{k} ::= "" | {after}"<" xml_text1 | [^<{_class_char(tag[k])}] {_TEXT_RULE}')
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


def forced_call_grammar(functions: Sequence[tuple[str, Any]], parallel: bool) -> str:
    """The EBNF grammar of a forced answer calling one of `functions` ((name, parameters schema)),
    or several, one per line, when `parallel`."""
    rules = [
        "root ::= call" + (' ("\\n" call)*' if parallel else ""),
        'call ::= "<tool_call>\\n" (' + " | ".join(f"f{i}" for i in range(len(functions))) + ') "\\n</tool_call>"',
    ]
    for i, (name, parameters) in enumerate(functions):
        rules += _function_rules(i, name, parameters)
    return "\n".join(rules + _text_rules() + _JSON_RULES) + "\n"
