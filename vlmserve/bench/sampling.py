"""How the benchmark's requests sample (`vlmserve bench --sampling SPEC ...`): 'checkpoint', the
checkpoint's generation_config.json (what a request that sets no sampling field gets, the
default), 'greedy', or values such as temperature=0.7,top_k=20,top_p=0.8 on top of the
checkpoint's (what a request that sets those fields gets); any of them with `+json`: each request
also follows its own JSON schema (structured outputs: the grammar masks every step). Standard
library only: the options are checked before torch is imported."""

from __future__ import annotations

import argparse
from typing import Any

# The SamplingParams fields a spec may set, and their types.
FIELDS: dict[str, type] = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repetition_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
}
# transformers' generate has no presence or frequency penalty (OpenAI's).
NOT_IN_TRANSFORMERS = ("presence_penalty", "frequency_penalty")


# The key sampling_fields adds for `+json`: run_vlmserve gives each request request_schema(index).
JSON_SCHEMA = "json_schema"


def request_schema(i: int) -> dict[str, Any]:
    """The i-th request's JSON schema: a string, a bounded integer, an enum array, a nested object
    (each request its own, so each compiles its own grammar)."""
    properties = {
        f"name{i}": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000 + i},
        "tags": {"type": "array", "items": {"enum": ["a", "b", f"t{i}"]}, "maxItems": 4},
        "nested": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    }
    return {"type": "object", "properties": properties, "required": list(properties)}


def sampling_spec(text: str) -> str:
    """argparse type: a spec as written, once its form is checked."""
    base = text.removesuffix("+json")
    if base not in ("greedy", "checkpoint"):
        _values(base)
    return text


def _values(text: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in FIELDS:
            raise argparse.ArgumentTypeError(
                f"{part!r}: a sampling spec is 'greedy', 'checkpoint' or FIELD=VALUE,... with FIELD one of "
                f"{', '.join(FIELDS)} (e.g. temperature=0.7,top_k=20,top_p=0.8)"
            )
        try:
            values[key] = FIELDS[key](value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: {key} takes a {FIELDS[key].__name__}") from None
    return values


def sampling_fields(spec: str, checkpoint_defaults: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams fields of `spec` (max_tokens left to each request) given the checkpoint's
    sampling defaults (vlmserve's Frontend.sampling_defaults)."""
    base = spec.removesuffix("+json")
    extra = {JSON_SCHEMA: True} if base != spec else {}
    if base == "greedy":
        return {"temperature": 0.0} | extra
    defaults = {k: v for k, v in checkpoint_defaults.items() if k != "max_tokens"}
    return (defaults if base == "checkpoint" else defaults | _values(base)) | extra


def hf_generate_kwargs(fields: dict[str, Any]) -> dict[str, Any]:
    """transformers' generate arguments that sample as `fields` do (every one given, so the
    checkpoint's generation_config.json does not add its own)."""
    unsupported = [k for k in (*NOT_IN_TRANSFORMERS, JSON_SCHEMA) if fields.get(k)]
    if unsupported:
        raise ValueError(
            f"transformers' generate has no {' or '.join(unsupported)}: put a --sampling spec without it first "
            "(transformers runs the first one), or pass --no-hf"
        )
    repetition = float(fields.get("repetition_penalty", 1.0))
    temperature = float(fields.get("temperature", 1.0))
    if temperature < 1e-5:  # SamplingParams.greedy
        return {"do_sample": False, "repetition_penalty": repetition, "temperature": None, "top_k": None, "top_p": None}
    return {
        "do_sample": True,
        "temperature": temperature,
        "top_k": int(fields.get("top_k", 0)) if fields.get("top_k", 0) > 0 else None,
        "top_p": float(fields.get("top_p", 1.0)),
        "min_p": float(fields["min_p"]) if fields.get("min_p") else None,
        "repetition_penalty": repetition,
    }
