"""Issue 13, item 1: one request never takes the engine process down.

(a) Sampling fields the engine cannot represent (past int64, 0 once rounded to float32) are
refused in the request schema with a 400 naming the field; the engine keeps its PID and a request
in flight gets the tokens it would have had alone.
(b) An exception while computing one request's step fails that request (RequestFailed naming it,
marked internal: the client gets a 500 that echoes nothing of it) and the engine goes on: the
others finish with their own tokens, nothing is left held.
(c) Issue 13: an exception while updating one request after its step fails that request alone;
one in the scheduler itself fails every request in flight and the engine goes on from empty
caches. Over HTTP, a request failed by the engine is a 500 naming the request (an error event
and [DONE] in a stream).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import Server, segments_left, start_server
from vlmserve.engine.checkpoint import load_engine_model
from vlmserve.engine.config import EngineConfig
from vlmserve.engine.core import EngineCore
from vlmserve.engine.engine_process import EngineLoop
from vlmserve.ipc.messages import AddRequest, RequestFailed, StepOutputs, encoder, from_engine_decoder
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.sampling_params import SamplingParams

PROMPT = [{"role": "user", "content": "Count to ten please."}]
INT64_MAX = 2**63 - 1

# (field, value): each passed the schema but is past what the engine can represent.
UNREPRESENTABLE = [
    ("top_p", 1e-50),  # positive in float64, 0.0 in float32: every token masked
    ("top_p", 1e-40),  # a float32 subnormal: flushed to zero on some devices
    ("top_k", 2**63),  # past int64
    ("top_k", 10**30),
    ("stop_token_ids", [2**64]),  # past uint64: cut the stream with no error event before
    ("stop_token_ids", [2**63]),  # past int64
]


def _chat(server: Server, **fields: object) -> httpx.Response:
    body = {"model": "tiny", "messages": PROMPT, **fields}
    return server.post("/v1/chat/completions", body)


def _stream_tokens(server: Server, body: dict) -> Iterator[str]:
    """The content pieces of a streamed chat completion, as they arrive."""
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, headers=server.headers, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                yield choice["delta"].get("content") or ""


@pytest.mark.parametrize(("field", "value"), UNREPRESENTABLE, ids=[f"{f}={v!r}"[:40] for f, v in UNREPRESENTABLE])
def test_unrepresentable_sampling_field_gets_400_naming_it_and_engine_keeps_its_pid(
    server: Server, field: str, value: object
) -> None:
    engine = server.engine_pid()
    response = _chat(server, **{"temperature": 0.7, "max_tokens": 4, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in error["message"] or error["param"] == field, error
    assert "Traceback" not in response.text and "torch" not in response.text
    # The engine got nothing it could choke on: same process, healthy, no segment left.
    ok = _chat(server, max_tokens=2, temperature=0.0)
    assert ok.status_code == 200, ok.text
    assert server.engine_pid() == engine
    assert server.health() == 200
    assert segments_left() == []


def test_request_in_flight_gets_its_own_tokens_while_unrepresentable_fields_are_refused(server: Server) -> None:
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    alone = _chat(server, **{k: v for k, v in body.items() if k not in ("model", "messages")})
    assert alone.status_code == 200
    engine = server.engine_pid()
    pieces = _stream_tokens(server, body)
    got = [next(pieces)]  # the stream is running in the engine now
    for field, value in UNREPRESENTABLE:
        assert _chat(server, **{"temperature": 0.7, "max_tokens": 4, field: value}).status_code == 400
    got.extend(pieces)
    assert "".join(got) == alone.json()["choices"][0]["message"]["content"]
    assert server.engine_pid() == engine and server.health() == 200


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_p", 1e-50), ("top_k", 2**63), ("temperature", 1e39), ("seed", 2**63), ("stop_token_ids", [2**63])],
)
def test_offline_sampling_params_refuse_unrepresentable_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_seeded_children_near_int64_max_keep_a_seed_the_engine_accepts() -> None:
    params = SamplingParams(n=3, seed=INT64_MAX)
    seeds = [params.for_child(i).seed for i in range(3)]
    assert len(set(seeds)) == 3 and all(s is not None and -(2**63) <= s <= INT64_MAX for s in seeds)


# -- (b): a failure inside one request's step ---------------------------------------------------


class Push:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, data: bytes) -> None:
        self.sent.append(from_engine_decoder.decode(data))


POISON_SEED = 4242


@pytest.fixture(scope="module")
def core(tiny_dir: Path) -> EngineCore:
    config = EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20)
    return EngineCore(config, load_engine_model(config, [151645]))


def _poison_sampler(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler raises for a row with the poison seed from its third token on (the others'
    runner state has moved on by then), after sampling the rows before it (so their generators
    have moved too)."""
    real = core.runner.sampler
    calls = [0]

    def sampler(logits, params, generators, *rest):  # type: ignore[no-untyped-def]
        poisoned = [i for i, p in enumerate(params) if p.seed == POISON_SEED]
        calls[0] += bool(poisoned)
        if poisoned and calls[0] >= 3:
            k = poisoned[0]  # the rows before it, with their histories (no grammar in this test)
            real(logits[:k], params[:k], generators[:k], *[None if r is None else r[:k] for r in rest])
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, params, generators, *rest)

    monkeypatch.setattr(core.runner, "sampler", sampler)


def _serve(loop: EngineLoop, core: EngineCore, push: Push) -> dict[str, list[int]]:
    """Step the engine as its process does until idle; the token ids each request got."""
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        loop._step()
    else:
        raise AssertionError("requests did not finish in 500 steps")
    tokens: dict[str, list[int]] = {}
    for message in push.sent:
        if isinstance(message, StepOutputs):
            for o in message.outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


def _requests() -> dict[str, tuple[list[int], list[SamplingParams]]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=8, ignore_eos=True)
    return {
        "a": ([1, 2, 3, 4, 5], [greedy]),
        "c": ([9, 8, 7], [seeded]),
        "d": ([11, 12, 13, 14], [greedy, seeded]),  # n=2: children "0_d" and "1_d"
    }


def _add(loop: EngineLoop, request_id: str, prompt: list[int], params: list[SamplingParams]) -> None:
    child_ids = [request_id] if len(params) == 1 else [f"{i}_{request_id}" for i in range(len(params))]
    message = AddRequest(request_id, child_ids, params, ProcessedPrompt(prompt, [], None, 0), [])
    loop._handle(encoder.encode(message))


def test_step_failure_fails_only_that_request_and_others_get_their_tokens_alone(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone: dict[str, list[int]] = {}
    for request_id, (prompt, params) in _requests().items():
        push = Push()
        loop = EngineLoop(core, None, push, os.getppid())  # type: ignore[arg-type]
        _add(loop, request_id, prompt, params)
        alone.update(_serve(loop, core, push))

    _poison_sampler(core, monkeypatch)
    push = Push()
    loop = EngineLoop(core, None, push, os.getppid())  # type: ignore[arg-type]
    poison = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=8, ignore_eos=True)
    requests = _requests()
    for request_id in ("a", "c", "d"):
        _add(loop, request_id, *requests[request_id])
    _add(loop, "bad", [5, 6, 7, 8], [SamplingParams(temperature=0.0, max_tokens=8), poison])
    together = _serve(loop, core, push)

    failed = [m for m in push.sent if isinstance(m, RequestFailed)]
    assert [m.request_id for m in failed] == ["bad"]  # once, by the id the API process knows
    assert failed[0].internal  # the engine's error, not the request's: a 500
    assert "RuntimeError" in failed[0].message and "Traceback" not in failed[0].message
    # Every other request, seeded ones included, as if alone ("0_bad" may have had a token
    # before its sibling failed: the API process drops it with the request).
    assert {k: v for k, v in together.items() if not k.endswith("bad")} == alone
    assert core.kv.usage == 0.0 and not core.scheduler.requests
    assert not core.has_unfinished_requests()
    loop._step()  # the runner forgets what it held for the failed request at its next step
    assert core.runner.requests == {} and core.runner.encoder_cache == {}
    assert core.scheduler.encoder_cache.free_space() == core.scheduler.encoder_cache.capacity


def test_step_failure_for_every_request_fails_them_all_and_the_engine_serves_the_next(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    push = Push()
    loop = EngineLoop(core, None, push, os.getppid())  # type: ignore[arg-type]

    def broken(*args: object) -> None:
        raise RuntimeError("device lost")

    with monkeypatch.context() as patch:
        patch.setattr(core.runner.model, "compute_logits", broken)
        _add(loop, "x", [1, 2, 3], [SamplingParams(temperature=0.0, max_tokens=4)])
        _add(loop, "y", [4, 5, 6], [SamplingParams(temperature=0.0, max_tokens=4)])
        _serve(loop, core, push)
    failed = [m for m in push.sent if isinstance(m, RequestFailed)]
    assert sorted(m.request_id for m in failed) == ["x", "y"] and all(m.internal for m in failed)
    assert core.kv.usage == 0.0
    push.sent.clear()
    _add(loop, "z", [1, 2, 3], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)])
    assert len(_serve(loop, core, push)["z"]) == 4


# -- (c): failures in the scheduler's own work -----------------------------------------------------


def _alone(core: EngineCore) -> dict[str, list[int]]:
    """Each of _requests() served by itself: the tokens each engine request gets."""
    tokens: dict[str, list[int]] = {}
    for request_id, (prompt, params) in _requests().items():
        push = Push()
        loop = EngineLoop(core, None, push, os.getppid())  # type: ignore[arg-type]
        _add(loop, request_id, prompt, params)
        tokens.update(_serve(loop, core, push))
    return tokens


def _all_free(core: EngineCore) -> bool:
    """Nothing held anywhere: every KV block free, no request in the scheduler or the runner,
    no encoder output (the runner forgets a finished request at the step after it ends)."""
    encoder = core.scheduler.encoder_cache
    return (
        core.kv.pool.num_free == core.kv.pool.num_blocks
        and not core.kv.block_ids
        and not core.scheduler.requests
        and not core.runner.requests
        and not core.runner.encoder_cache
        and encoder.free_space() == encoder.capacity
    )


def test_an_update_that_raises_fails_only_that_request_and_frees_its_blocks(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = _alone(core)
    real = core.kv.step_succeeded

    def step_succeeded(request, num_computed_tokens):  # type: ignore[no-untyped-def]
        # The poisoned sample's update raises once it has two tokens (its blocks are held).
        if request.params.seed == POISON_SEED and len(request.output_token_ids) >= 2:
            raise RuntimeError("injected update failure")
        return real(request, num_computed_tokens)

    monkeypatch.setattr(core.kv, "step_succeeded", step_succeeded)
    push = Push()
    loop = EngineLoop(core, None, push, os.getppid())  # type: ignore[arg-type]
    requests = _requests()
    for request_id in ("a", "c"):
        _add(loop, request_id, *requests[request_id])
    poison = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=8, ignore_eos=True)
    _add(loop, "bad", [5, 6, 7, 8], [SamplingParams(temperature=0.0, max_tokens=8), poison])
    _add(loop, "d", *requests["d"])
    together = _serve(loop, core, push)

    failed = [m for m in push.sent if isinstance(m, RequestFailed)]
    assert [(m.request_id, m.internal) for m in failed] == [("bad", True)]
    assert len(together["1_bad"]) == 2  # it ran until its update raised
    assert {k: v for k, v in together.items() if not k.endswith("bad")} == alone
    loop._step()  # the runner forgets the failed request at the next step
    assert _all_free(core)


def test_a_scheduler_error_fails_every_request_in_flight_and_the_engine_goes_on_from_empty_caches(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    alone = _alone(core)
    real = core.kv.allocate_slots
    calls = [0]

    def allocate_slots(*args, **kwargs):  # type: ignore[no-untyped-def]
        # Raises once, mid-schedule in the second step: the requests before it already hold
        # this step's blocks, the scheduler's lists are half updated.
        calls[0] += 1
        if calls[0] == 8:
            raise RuntimeError("injected scheduler failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(core.kv, "allocate_slots", allocate_slots)
    push = Push()
    loop = EngineLoop(core, None, push, os.getppid())  # type: ignore[arg-type]
    requests = _requests()
    for request_id in ("a", "c", "d"):
        _add(loop, request_id, *requests[request_id])
    before = _serve(loop, core, push)
    assert calls[0] >= 8 and 0 < sum(map(len, before.values())) < sum(map(len, alone.values()))
    failed = [m for m in push.sent if isinstance(m, RequestFailed)]
    assert sorted((m.request_id, m.internal) for m in failed) == [("a", True), ("c", True), ("d", True)]
    assert _all_free(core) and loop.parents == {}

    # The engine goes on: the same requests again get the tokens they get alone.
    push = Push()
    loop = EngineLoop(core, None, push, os.getppid())  # type: ignore[arg-type]
    for request_id in ("a", "c", "d"):
        _add(loop, request_id, *requests[request_id])
    assert _serve(loop, core, push) == alone
    loop._step()
    assert _all_free(core)


# -- (c) over HTTP: a request the engine fails is a 500 ---------------------------------------------

FAULTY_ENGINE = Path(__file__).parent / "faulty_engine"  # its sitecustomize poisons the sampler


@pytest.fixture(scope="module")
def faulty(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose engine fails every request seeded POISON_SEED (and only those)."""
    path = [str(FAULTY_ENGINE), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(path), "VLMSERVE_TEST_POISON_SEED": str(POISON_SEED)}
    s = start_server(tiny_dir, tmp_path_factory.mktemp("faulty"), env=env)
    yield s
    s.stop()


def _events(server: Server, path: str, body: dict) -> list[dict | str]:
    """Every event of a streamed answer, [DONE] as the string."""
    with httpx.stream("POST", server.url + path, json=body, headers=server.headers, timeout=120) as response:
        assert response.status_code == 200
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


INTERNAL = r"^internal error while computing this request \((chatcmpl|cmpl)-[0-9a-f]{32}(-0)?\)$"


def _internal_error(error: dict) -> None:
    assert re.match(INTERNAL, error["message"]), error
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert "injected" not in json.dumps(error) and "secret" not in json.dumps(error)


def test_a_request_the_engine_fails_gets_500_naming_it_and_the_others_are_unchanged(faulty: Server) -> None:
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    alone = faulty.post("/v1/chat/completions", body)
    assert alone.status_code == 200
    engine = faulty.engine_pid()
    pieces = _stream_tokens(faulty, body)
    got = [next(pieces)]  # running in the engine while the poisoned requests fail beside it

    poisoned = {"seed": POISON_SEED, "temperature": 1.0, "max_tokens": 4}
    response = _chat(faulty, **poisoned)
    assert response.status_code == 500, response.text
    _internal_error(response.json()["error"])
    response = faulty.post("/v1/completions", {"model": "tiny", "prompt": "Hello", **poisoned})
    assert response.status_code == 500, response.text
    _internal_error(response.json()["error"])
    for path, request in [
        ("/v1/chat/completions", {"model": "tiny", "messages": PROMPT}),
        ("/v1/completions", {"model": "tiny", "prompt": "Hello"}),
    ]:
        events = _events(faulty, path, {**request, **poisoned, "stream": True})
        assert events[-1] == "[DONE]" and isinstance(events[-2], dict), events
        _internal_error(events[-2]["error"])

    got.extend(pieces)
    assert "".join(got) == alone.json()["choices"][0]["message"]["content"]
    assert faulty.engine_pid() == engine and faulty.health() == 200
    assert segments_left() == []
    assert "injected sampler failure" in faulty.log.read_text()  # the details are in the log
