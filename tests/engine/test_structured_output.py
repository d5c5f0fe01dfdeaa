"""Structured outputs through the offline engine on the random-weight tiny Qwen2.5-VL: whatever
the weights, the grammar mask forces every answer into its JSON schema, choice or regex. The
schemas bound every value (enums, maxLength, integer ranges, maxItems) so that the mask alone
brings each answer to its end within max_tokens."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jsonschema_rs
import pytest
import torch

from vlmserve import LLM, SamplingParams
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


# Strings whose length is bounded, as values and as property names: xgrammar's own grammar for
# them let raw control characters through (json.loads: "Invalid control character").
BOUNDED_STRINGS = [
    {"type": "string", "maxLength": 12},
    {"type": "string", "minLength": 2},
    {"type": "object", "propertyNames": {"maxLength": 6}, "additionalProperties": {"type": "integer"}},
]


@pytest.mark.parametrize("schema", BOUNDED_STRINGS, ids=["maxLength", "minLength", "propertyNames"])
def test_no_raw_control_character_is_allowed_inside_a_json_string(llm: LLM, schema: dict) -> None:
    """Inside a string, every token the mask allows is free of raw control characters (bytes
    0x00-0x1f), which JSON forbids there; printable text still is allowed."""
    engine = llm.llm_engine
    tokenizer = engine.tokenizer
    vocab = engine.model_config.text.vocab_size
    state = engine.core.grammars.matcher(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    opening = '{"' if schema["type"] == "object" else '"'
    for token_id in tokenizer.encode(opening):
        state.accept(token_id)
    bitmask, rows = TokenBitmask(vocab).fill([state])
    logits = torch.zeros(1, vocab)
    apply_token_bitmask(logits, bitmask, rows)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert tokenizer.encode("abc")[0] in allowed
    raw = [t for t in allowed if any(b < 0x20 for b in tokenizer.token_bytes(t))]  # type: ignore[attr-defined]
    assert raw == [], [tokenizer.token_bytes(t) for t in raw[:5]]  # type: ignore[attr-defined]


def test_answers_with_bounded_strings_parse_as_json_whatever_is_drawn(llm: LLM) -> None:
    """Temperature 1 over many seeds, with tab and other control-character tokens favoured: each
    answer is JSON that json.loads reads and that follows its schema."""
    tokenizer = llm.llm_engine.tokenizer
    control = {tokenizer.encode(ch)[0]: 8.0 for ch in ("\t", "\x01", "\x0b", "\x1f")}
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "tag": {"type": "string", "minLength": 1}},
        "required": ["name", "tag"],
        "additionalProperties": False,
    }
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=60,
            logit_bias=control,
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
        for seed in range(16)
    ]
    finished = 0
    for output in llm.generate(["Name and tag as JSON:"] * len(params), params):
        completion = output.outputs[0]
        if completion.finish_reason != "stop":
            continue  # a minLength string may run on past max_tokens
        finished += 1
        value = json.loads(completion.text)
        assert jsonschema_rs.validator_for(schema).is_valid(value), completion.text
    assert finished >= 4


def test_the_core_fills_each_steps_masks_once_and_its_matchers_take_only_steps_that_succeeded(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine core holds the matchers and fills a step's masks for the requests the step
    samples (not for a prompt chunk that stops short, nor for a request without a grammar); a
    token is accepted once its step succeeded, so a failed step leaves the matcher as it was."""
    core = llm.llm_engine.core
    tokenizer = llm.get_tokenizer()
    spec = StructuredOutputsParams(regex=r"ab(c|d)e")
    prompt = tokenizer.encode("Spell it:")
    steps = []
    execute = core.executor.execute

    def recording(step):  # type: ignore[no-untyped-def]
        steps.append((list(step.num_scheduled_tokens), list(step.structured_output_request_ids), step.grammar_bitmask))
        return execute(step)

    monkeypatch.setattr(core.executor, "execute", recording)
    core.add_request("g", llm.llm_engine.processor.process(prompt, []), SamplingParams(structured_outputs=spec))
    assert "g" in core.structured_outputs.waiting  # its grammar compiles; steps with nothing to run wait for it
    while core.structured_outputs.waiting:
        assert core.step() == []
    core.add_request("plain", llm.llm_engine.processor.process(prompt, []), SamplingParams(max_tokens=2))
    assert core.structured_outputs.matchers.keys() == {"g"}
    outputs = core.step()
    scheduled, with_grammar, bitmask = steps[-1]
    assert scheduled == ["g", "plain"] and with_grammar == ["g"] and bitmask is not None and bitmask.shape[0] == 1
    allowed = ((bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten().nonzero().flatten().tolist()
    assert {tokenizer.decode([t]) for t in allowed} <= {
        "a",
        "ab",
        "abc",
        "abd",
        "abce",
        "abde",
    }  # what may start "ab(c|d)e"
    (g,) = [o for o in outputs if o.request_id == "g"]
    assert core.structured_outputs.matchers["g"].num_accepted == len(g.new_token_ids) == 1
    # A step that fails outside any one request (here: the executor raises) takes no token.
    monkeypatch.setattr(core.executor, "execute", lambda step: (_ for _ in ()).throw(RuntimeError("boom")))
    assert core.step() == [] and "g" in core.take_failed()
    assert core.structured_outputs.matchers == {}  # the reset forgot every request, matchers too


def test_spec_travels_as_plain_data() -> None:
    """SamplingParams cross to the engine process by msgspec: the spec arrives whole, the schema
    as its JSON text."""
    from vlmserve.ipc import serial

    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(json={"type": "object"}, disable_any_whitespace=True)
    )
    back = serial.decoder(SamplingParams).decode(serial.encode(params))
    assert back.structured_outputs == StructuredOutputsParams(json='{"type": "object"}', disable_any_whitespace=True)
    assert back.structured_outputs.key == ("json", '{"type": "object"}', False)


def _nested_arrays(depth: int) -> dict:
    """A small schema (28 bytes a level) whose compile takes long: 400 levels, 11 kB, take 2.5 s of
    CPU on the development machine (AMD EPYC, 2 cores), 500 levels 4.8 s."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_grammar_that_compiles_for_long_holds_up_no_other_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grammar compiles beside the steps: a plain request added after it finishes while it
    compiles; the grammar's request runs once its grammar is ready."""
    engine = llm.llm_engine
    real = engine.core.grammars.compile

    def slow(spec: StructuredOutputsParams):  # type: ignore[no-untyped-def]
        time.sleep(2.0)  # a long compile (xgrammar's releases the GIL, as sleeping does)
        return real(spec)

    monkeypatch.setattr(engine.core.grammars, "compile", slow)
    tokenizer = llm.get_tokenizer()
    spec = StructuredOutputsParams(regex=r"[a-z]{3}!")
    start = time.monotonic()
    engine.add_request(
        "slow",
        engine.processor.process(tokenizer.encode("Spell:"), []),
        SamplingParams(temperature=1.0, seed=0, max_tokens=8, structured_outputs=spec),
    )
    plain = SamplingParams(temperature=0, max_tokens=4)
    engine.add_request("plain", engine.processor.process(tokenizer.encode("Once upon a time"), []), plain)
    finished: dict[str, tuple[float, str]] = {}
    while len(finished) < 2:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = (time.monotonic() - start, output.outputs[0].text)
    assert finished["plain"][0] < 1.0, finished  # not held up by the 2 s compile
    assert finished["slow"][0] >= 2.0 and re.fullmatch(r"[a-z]{3}!", finished["slow"][1]), finished


def test_a_grammar_larger_than_the_whole_cache_is_refused(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    class Huge:
        memory_size_bytes = 1 << 40

    monkeypatch.setattr(llm.llm_engine.core.grammars, "compile", lambda spec: Huge())
    spec = StructuredOutputsParams(regex="huge")
    with pytest.raises(ValueError, match=r"needs 1048576 MiB, more than the whole grammar cache of 512 MiB"):
        llm.generate("x", SamplingParams(max_tokens=2, structured_outputs=spec))
    assert spec.key not in llm.llm_engine.core.structured_outputs.cache


@pytest.fixture(scope="module")
def limited(tiny25_dir: Path) -> LLM:
    """Small limits: a grammar cache of 0.05 GiB (seven 7 MB grammars) and 0.3 s of CPU a compile."""
    return LLM(
        tiny25_dir,
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory_gib=0.05,
        grammar_cache_gib=0.05,
        max_grammar_compile_seconds=0.3,
    )


def test_a_compile_past_the_time_limit_fails_its_request_alone(limited: LLM) -> None:
    deep = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=_nested_arrays(400)))
    message = r"compiling the JSON schema took more than 0.3 s of CPU time.*--max-grammar-compile-seconds"
    with pytest.raises(ValueError, match=message):
        limited.generate("x", deep)
    outputs = limited.llm_engine.core.structured_outputs
    # Asked again, it is refused at once (a retrying client holds no second thread).
    start = time.monotonic()
    with pytest.raises(ValueError, match=message):
        limited.generate("x", deep)
    assert time.monotonic() - start < 0.5 and outputs.num_timed_out == 1
    # The engine goes on: another grammar compiles on the other thread while the abandoned
    # compile runs on (its result dropped when it ends).
    ok = limited.generate("x", SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(choice=["ok"])))
    assert ok[0].outputs[0].text == "ok"
    assert limited.generate("x", SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].finish_reason == "length"


def test_compiled_grammars_stay_within_their_cache_over_many_schemas(limited: LLM) -> None:
    """30 distinct schemas of 7 MB each, ten at a time (70 MB in use at once, over the 54 MB cache:
    the compiles beyond it wait for requests to finish): the grammars held stay within the cache
    once the requests are done, and so does the process's memory."""
    from vlmserve.engine.memory import PeakMeter, _release_free_heap

    structured = limited.llm_engine.core.structured_outputs
    cache = structured.cache
    meter = PeakMeter(torch.device("cpu"))
    limited.generate("x", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(json=schema(0))))
    _release_free_heap()
    before = meter.current()
    for batch in range(3):
        specs = [StructuredOutputsParams(json=schema(1000 + 10 * batch + i)) for i in range(10)]
        params = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=6, structured_outputs=s) for i, s in enumerate(specs)
        ]
        outputs = limited.generate(["Answer as JSON:"] * 10, params)
        assert all(o.outputs[0].text.startswith("{") for o in outputs)
        assert cache.num_bytes <= cache.capacity_bytes and cache.num_pinned == 0
    assert cache.evictions >= 30 - 7 and not structured.waiting and not structured.matchers
    _release_free_heap()
    grown = meter.current() - before
    assert grown < cache.capacity_bytes + (30 << 20), grown / (1 << 20)  # one grammar is 7 MB
