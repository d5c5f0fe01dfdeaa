"""Structured outputs through the offline engine on the random-weight tiny Qwen2.5-VL: whatever
the weights, the grammar mask forces every answer into its JSON schema, choice or regex. The
schemas bound every value (enums, maxLength, integer ranges, maxItems) so that the mask alone
brings each answer to its end within max_tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema_rs
import pytest
import torch

from vlmserve import LLM, SamplingParams
from vlmserve.engine.model_runner import CachedRequestState
from vlmserve.engine.structured_output import TokenBitmask, apply_token_bitmask
from vlmserve.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def llm(tiny25_dir: Path) -> LLM:
    return LLM(tiny25_dir, dtype="float32", max_model_len=1024, kv_cache_memory_gib=0.05)


def schema(i: int) -> dict:
    """20 different schemas, each of bounded size."""
    kinds = [
        {"type": "integer", "minimum": -5, "maximum": 40 + i},
        {"type": "boolean"},
        {"enum": ["red", "green", f"c{i}"]},
        {"type": "string", "maxLength": 1 + i % 4},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 1 + i % 3},
        {"type": "object", "properties": {"x": {"const": i}}, "required": ["x"], "additionalProperties": False},
        {"type": "null"},
    ]
    names = [f"k{i}_{j}" for j in range(1 + i % 3)]
    properties = {name: kinds[(i + j) % len(kinds)] for j, name in enumerate(names)}
    return {"type": "object", "properties": properties, "required": names, "additionalProperties": False}


@pytest.mark.slow
def test_twenty_schemas_in_one_batch_all_valid(llm: LLM) -> None:
    schemas = [schema(i) for i in range(20)]
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=200,
            # Half with whitespace between elements (capped), half without.
            structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=i % 2 == 0),
        )
        for i, s in enumerate(schemas)
    ]
    prompts = [f"Answer {i} as JSON:" for i in range(20)]
    outputs = llm.generate(prompts, params)
    for s, output in zip(schemas, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text  # the grammar ended it, not max_tokens
        value = json.loads(completion.text)
        assert jsonschema_rs.validator_for(s).is_valid(value), (s, completion.text)
    # The masks made the answers: without them the same weights write no JSON at all.
    plain = llm.generate(prompts[:3], SamplingParams(temperature=1.0, seed=0, max_tokens=20))
    for output in plain:
        with pytest.raises(ValueError):
            json.loads(output.outputs[0].text)


def test_json_object(llm: LLM) -> None:
    spec = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    # A random model may write an object longer than any max_tokens; the mask makes each token valid.
    out = llm.generate("Give JSON:", SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec))[0]
    assert out.outputs[0].text.startswith("{")


def test_choice_and_regex(llm: LLM) -> None:
    choices = ["yes", "no", "maybe so", "ça dépend"]
    outs = llm.generate(
        ["Pick:"] * 8,
        [
            SamplingParams(
                temperature=1.0, seed=s, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=choices)
            )
            for s in range(8)
        ],
    )
    answers = [o.outputs[0].text for o in outs]
    assert all(a in choices for a in answers), answers
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    pattern = r"[0-9]{3}-[a-z]{2,4}(!|\?)"
    outs = llm.generate(
        ["Code:"] * 6,
        [
            SamplingParams(
                temperature=1.0, seed=s, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=pattern)
            )
            for s in range(6)
        ],
    )
    texts = [o.outputs[0].text for o in outs]
    assert all(re.fullmatch(pattern, t) for t in texts), texts
    assert len(set(texts)) > 1  # drawn, not one forced string


def test_structured_and_plain_requests_share_a_batch(llm: LLM) -> None:
    """A plain request in the same batch gets exactly what it gets alone."""
    plain = SamplingParams(temperature=0, max_tokens=8)
    alone = llm.generate("Once upon a time", plain)[0].outputs[0].token_ids
    spec = StructuredOutputsParams(choice=["alpha", "beta"])
    both = llm.generate(
        ["Once upon a time", "Pick:"], [plain, SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec)]
    )
    assert both[0].outputs[0].token_ids == alone
    assert both[1].outputs[0].text in ("alpha", "beta")


def test_bad_specs_are_refused_with_the_reason(llm: LLM) -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="regex could not be compiled"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    with pytest.raises(ValueError, match="JSON schema could not be compiled"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json="{not json")))
    # The engine goes on.
    ok = llm.generate("x", SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(choice=["ok"])))
    assert ok[0].outputs[0].text == "ok"


def test_padded_vocabulary_ids_are_never_allowed(llm: LLM) -> None:
    """The model's logits have 151936 columns, the tokenizer 151657 tokens: the rest stay masked,
    and eos is allowed only where the grammar may end."""
    engine = llm.llm_engine
    grammars = engine.core.grammars
    vocab = engine.model_config.text.vocab_size
    num_tokens = engine.tokenizer.vocab_size  # type: ignore[attr-defined]
    assert num_tokens < vocab
    eos = sorted(engine.eos_token_ids)
    state = grammars.matcher(StructuredOutputsParams(regex=r"[a-z]*"))  # may end anywhere, even empty
    bitmask, rows = TokenBitmask(vocab).fill([None, state])
    assert rows == [1]
    logits = torch.zeros(2, vocab)
    apply_token_bitmask(logits, bitmask, rows)
    assert torch.isfinite(logits[0]).all()  # the row without a grammar is untouched
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert all(t < num_tokens for t in allowed)
    assert set(eos) <= set(allowed)
    must_continue = grammars.matcher(StructuredOutputsParams(regex=r"[a-z]+"))
    bitmask, rows = TokenBitmask(vocab).fill([must_continue])
    logits = torch.zeros(1, vocab)
    apply_token_bitmask(logits, bitmask, rows)
    assert not any(torch.isfinite(logits[0, eos]))  # eos only once the grammar may end


def test_matcher_follows_the_output_when_a_step_is_undone(llm: LLM) -> None:
    """The runner's matcher is rebuilt from the request's output wherever they disagree (a failed
    step undone trims the output; a preempted request keeps both)."""
    runner = llm.llm_engine.runner
    spec = StructuredOutputsParams(regex=r"ab(c|d)e")
    tokenizer = llm.get_tokenizer()
    prompt = [1, 2, 3]
    state = CachedRequestState(
        "r", prompt + tokenizer.encode("ab"), 3, [], None, 0, SamplingParams(structured_outputs=spec), None, [], 0, []
    )
    (grammar,) = runner._grammar_states([state])
    assert grammar is not None and grammar.num_accepted == len(tokenizer.encode("ab"))
    del state.token_ids[3:]  # the step that produced "ab" undone
    (grammar,) = runner._grammar_states([state])
    assert grammar is not None and grammar.num_accepted == 0
    assert grammar.matcher.accept_string("abde")


def test_spec_travels_as_plain_data() -> None:
    """SamplingParams cross to the engine process by msgspec: the spec arrives whole, the schema
    as its JSON text."""
    from vlmserve.engine import serial

    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    )
    back = serial.decoder(SamplingParams).decode(serial.encode(params))
    assert back.structured_outputs == StructuredOutputsParams(json='{"type": "object"}', disable_any_whitespace=True)
    assert back.structured_outputs.key == ("json", '{"type": "object"}', False)
