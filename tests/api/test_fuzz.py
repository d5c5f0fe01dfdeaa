"""Property-based fuzzing of the request bodies: whatever arrives, never a 5xx, and every 4xx
comes in OpenAI's error shape (BAD_INPUTS 29)."""

from __future__ import annotations

import base64
import copy
import json
import math
import os
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.conftest import Server, data_url, picture, segments_left

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "image", "video", "input_audio", "x"])},
    optional={"text": values, "image_url": values, "image": values, "min_pixels": values},
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "bad"]) | values},
    optional={"content": values | st.text(max_size=30) | st.lists(part, max_size=3)},
)
chat_body = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=3) | values},
    optional={
        key: values
        for key in (
            "max_tokens",
            "n",
            "temperature",
            "top_p",
            "top_k",
            "stop",
            "seed",
            "stream",
            "logprobs",
            "top_logprobs",
            "stream_options",
            "max_completion_tokens",
        )
    },
)
completion_body = st.fixed_dictionaries(
    {"prompt": values | st.lists(st.integers(-5, 200_000), max_size=5)},
    optional={key: values for key in ("max_tokens", "n", "temperature", "stop", "logprobs", "stream", "echo")},
)


def check(server: Server, path: str, body: object) -> None:
    # NaN and Infinity go out as the literals Python's encoder writes: some clients send them.
    content = json.dumps(body).encode("utf-8", "surrogatepass")
    headers = {**server.headers, "content-type": "application/json"}
    response = httpx.post(server.url + path, content=content, headers=headers, timeout=60)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=chat_body)
def test_chat_bodies(server: Server, body: dict) -> None:
    _short(body, "max_tokens", "max_completion_tokens")
    check(server, "/v1/chat/completions", body)


def _count(value: object) -> float | None:
    """The count the server takes `value` as: an int, or a whole float or numeric string (2003.0
    and "2003" are the int 2003, as in vLLM: up to 2003 tokens, past a request timeout on a slow
    machine). None: not a count."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None
    if isinstance(value, int):
        return value
    return value if isinstance(value, float) and value.is_integer() else None


def _short(body: dict, *keys: str) -> None:
    """Valid bodies generate a few tokens, not up to the context limit (the default)."""
    for key in keys:
        value = body.get(key)
        count = _count(value)
        # An int past 3 (any); a float or string past 3 that the server accepts (a larger one
        # is refused, cheaply, and stays). Bounded as its own type: 3.0, "3".
        if count is not None and count > 3 and (isinstance(value, int) or count < 4096):
            body[key] = type(value)(3)
    if all(body.get(key) is None for key in keys):  # missing or null: up to the context limit
        body[keys[0]] = 3


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=completion_body)
def test_completion_bodies(server: Server, body: dict) -> None:
    _short(body, "max_tokens")
    check(server, "/v1/completions", body)


# The values at which numbers stop being representable in the engine: int64's edges and past them,
# float32's zero, subnormals and overflow, non-finite floats, and the ordinary values beside them.
INT_EXTREMES = [0, 1, -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**30]
FLOAT_EXTREMES = [0.0, -0.0, 1e-50, 1e-40, 1.4e-45, 5e-324, 1e-38, 1.1754944e-38, 1e-7, 0.5, 1.0, 1.0000001, 2.0]
FLOAT_EXTREMES += [3.4028235e38, 3.5e38, 1e308, float("inf"), float("-inf"), float("nan")]
number = st.sampled_from(INT_EXTREMES) | st.sampled_from(FLOAT_EXTREMES)
NUMERIC_FIELDS = ("max_tokens", "n", "temperature", "top_p", "top_k", "seed", "logprobs", "top_logprobs")
extreme_body = st.fixed_dictionaries(
    {"messages": st.just([{"role": "user", "content": "x"}])},
    optional={
        **{key: number for key in NUMERIC_FIELDS},
        "stop_token_ids": st.lists(st.sampled_from(INT_EXTREMES), min_size=1, max_size=3),
        "max_completion_tokens": number,
    },
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=extreme_body)
def test_numeric_extremes_get_an_answer_or_a_4xx_and_never_restart_the_engine(server: Server, body: dict) -> None:
    engine = server.engine_pid()
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2  # a valid n generates a few samples, not thousands
    _short(body, "max_tokens", "max_completion_tokens")
    check(server, "/v1/chat/completions", body)
    assert server.engine_pid() == engine, ("the engine restarted", body)
    assert server.health() == 200


# -- schema-driven: every field the published OpenAPI schema names (issue 13) ------------------------
#
# schemathesis reads the running server's /openapi.json (which describes the messages and their
# content parts too) and sends, per POST endpoint: its coverage phase (each field at, inside and
# past each bound, each wrong type, each required field missing) and its fuzzing phase (random
# bodies, valid and not). Media URLs come from MEDIA: well-formed and broken images and videos,
# refused schemes and addresses. Then a walk over the same schema sets every field in turn to
# each of EXTREMES (values JSON can carry that a schema cannot describe: NaN, Infinity, lone
# surrogates, NUL, 2**64, deep nesting). Each answer is checked by answered_well(); the engine
# must be the same process throughout. VLMSERVE_FUZZ_EXAMPLES raises the fuzzing phase's examples
# per endpoint (default 25) for a longer run.

FUZZ_EXAMPLES = int(os.environ.get("VLMSERVE_FUZZ_EXAMPLES", "25"))


def _png_header(width: int, height: int) -> bytes:
    """A PNG's signature and header chunk claiming width x height, and no pixels."""
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))


def _data(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


SMALL_PNG = data_url(picture(5, (40, 30)))
NOT_A_VIDEO = _data("video/mp4", b"\x00\x00\x00\x18ftypmp42 not a video")


def _media() -> list[str]:
    small = picture(5, (40, 30))
    png = base64.b64decode(SMALL_PNG.split(",", 1)[1])
    return [
        SMALL_PNG,
        data_url(small, "JPEG"),
        data_url(small, "GIF"),
        data_url(small.convert("RGBA")),
        data_url(small.convert("L")),
        data_url(small.convert("P")),
        data_url(small.convert("CMYK"), "JPEG"),
        data_url(small.convert("I;16")),
        data_url(picture(6, (1, 1))),
        data_url(picture(7, (3, 3))),
        data_url(picture(8, (1, 400))),  # past the aspect-ratio limit
        _data("image/png", png[: len(png) // 2]),  # truncated
        _data("image/png", _png_header(65_535, 65_535)),  # a decompression bomb's header
        _data("image/png", b"not an image"),
        _data("image/png", b""),
        NOT_A_VIDEO,
        "data:image/png;base64,@@@@",
        "data:image/png,raw",
        "data:",
        "",
        "http://127.0.0.1:1/a.png",  # a loopback address: refused before any connection
        "http://[::1]/a.png",
        "file:///etc/passwd",  # no local media without --allowed-local-media-path
        "ftp://example.com/a.png",
        "/etc/passwd",
    ]


schemathesis.openapi.format("uri", st.sampled_from(_media()))


def answered_well(response: httpx.Response | schemathesis.Response, body: object) -> None:
    """Never a 5xx; a 4xx is OpenAI's error shape with a message, not typed as the server's fault;
    a 200 is a completion, or a stream of chunks (an error event in OpenAI's shape at most) ending
    in [DONE] (or, from vLLM's extra endpoints, their answers: tokens, a text, a status)."""
    status = response.status_code
    assert status < 500, (body, response.text[:2000])
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, (body, error)
        assert isinstance(error["message"], str) and error["message"], (body, error)
        assert error["type"] != "server_error", (body, error)
        return
    assert status == 200, (body, status)
    if "text/event-stream" in str(response.headers.get("content-type")):  # schemathesis': a list
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        if events and json.loads(events[0]).get("type") == "response.created":  # /v1/responses: typed events
            for event in map(json.loads, events):
                assert event["type"].startswith("response.") or event["type"] == "error", (body, event)
                assert event.get("code") != "internal_error", (body, event)
            return
        assert events and events[-1] == "[DONE]", (body, response.text[-500:])
        for event in map(json.loads, events[:-1]):
            if "error" in event:
                assert event["error"]["type"] != "server_error", (body, event)
            else:
                assert event["object"] in ("chat.completion.chunk", "text_completion"), (body, event)
                assert isinstance(event["choices"], list), (body, event)
        return
    answer = response.json()
    if "tokens" in answer:  # /tokenize
        assert answer["count"] == len(answer["tokens"]), (body, answer)
        return
    if set(answer) in ({"prompt"}, {"status"}):  # /detokenize, /ping
        return
    assert answer["object"] in ("chat.completion", "text_completion", "response"), (body, answer)
    if answer["object"] == "response":
        assert answer["status"] in ("completed", "incomplete") and answer["output"], answer
        return
    assert answer["choices"] and all(c["finish_reason"] in ("stop", "length") for c in answer["choices"]), answer
    assert answer["usage"]["completion_tokens"] >= len(answer["choices"]), answer


def _bounded(body: object, model: str | None, max_n: int = 8, max_model_len: int = 4096) -> None:
    """A body that would be accepted generates a few tokens: max_tokens past 3 and below the
    limit becomes 3, n past 2 and within --max-n becomes 2 (past the limits: refused, cheaply,
    so left as they are). With `model`, a string model becomes that name (the served one)."""
    if not isinstance(body, dict):
        return
    keys = ("max_tokens", "max_completion_tokens", "max_output_tokens")  # the last: /v1/responses'
    for key in keys:
        value = body.get(key)
        count = _count(value)
        if count is not None and 3 < count < max_model_len:
            body[key] = type(value)(3)  # as its own type: 3.0, "3"
    if all(body.get(key) is None for key in keys):
        body["max_tokens"] = 3  # not up to the context limit
        if "input" in body:
            body["max_output_tokens"] = 3
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and 2 < n <= max_n:
        body["n"] = 2
    if model is not None and isinstance(body.get("model"), str):
        body["model"] = model


@pytest.fixture(scope="module")
def served_model(server: Server) -> str:
    return str(server.get("/v1/models").json()["data"][0]["id"])


@pytest.fixture(scope="module")
def api_schema(server: Server) -> schemathesis.BaseSchema:
    raw = server.get("/openapi.json").json()
    config = schemathesis.Config.from_dict(
        {
            "base-url": server.url,
            "headers": server.headers,
            "request-timeout": 60,
            "generation": {"mode": "all", "max-examples": FUZZ_EXAMPLES},
            "phases": {"examples": {"enabled": False}, "stateful": {"enabled": False}},
        }
    )
    return schemathesis.openapi.from_dict(raw, config=config)


api = schemathesis.pytest.from_fixture("api_schema").include(method="POST")


@pytest.fixture(autouse=True)
def _node_id_for_schemathesis(request: pytest.FixtureRequest) -> None:
    """schemathesis' fixture-loaded tests read pytest's private Node._nodeid, which pytest 9.2 no
    longer has (the same break as pytest-benchmark#321): given back as the public nodeid."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


@pytest.mark.slow
@api.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_every_field_of_the_openapi_schema_gets_an_answer_or_a_4xx(
    case: schemathesis.Case, server: Server, served_model: str
) -> None:
    engine = server.engine_pid()
    _bounded(case.body, served_model)
    answered_well(case.call(), case.body)
    assert server.engine_pid() == engine, ("the engine restarted", case.body)


DEEP = 100_000  # levels of nesting: past any recursive parser's stack
EXTREMES: list[object] = [
    None,
    True,
    *(0, -1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1),
    *(0.0, -0.0, 1e-45, 1e-50, 3.5e38, 1e308, math.inf, -math.inf, math.nan),
    *("", "\x00", "\ud800", "x" * 100_000),  # the lone surrogate goes out as the escape \ud800
    *([], [0] * 10_000, {}),
    {str(2**64): 1e308, "-1": -math.inf, "\ud800": math.nan},  # logit_bias-like: token ids as keys
    "<deep list>",
    "<deep object>",
]


def _encoded(body: object) -> bytes:
    """The body as JSON, NaN and Infinity as Python writes them; the deep placeholders replaced by
    nesting no encoder would write."""
    text = json.dumps(body)
    text = text.replace('"<deep list>"', "[" * DEEP + "]" * DEEP)
    return text.replace('"<deep object>"', '{"a":' * DEEP + "{}" + "}" * DEEP).encode()


FieldPath = tuple[str | int, ...]


def _fields(node: dict, value: object, root: dict, path: FieldPath = ()) -> Iterator[FieldPath]:
    """The path of every field the schema `node` names, inside `value`'s shape: an object's
    properties (present or not), and into those present; an array's first item."""
    if "$ref" in node:
        node = root["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
    for branch in node.get("anyOf", [node]):
        if "$ref" in branch or "anyOf" in branch:
            yield from _fields(branch, value, root, path)
        if isinstance(value, dict):
            for name, sub in branch.get("properties", {}).items():
                yield (*path, name)
                if name in value:
                    yield from _fields(sub, value[name], root, (*path, name))
        if isinstance(value, list) and value and "items" in branch:
            yield (*path, 0)
            yield from _fields(branch["items"], value[0], root, (*path, 0))


def _with(body: dict, path: FieldPath, value: object) -> dict:
    body = copy.deepcopy(body)
    holder: Any = body
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    return body


def _bases(model: str) -> dict[str, list[dict]]:
    """Valid bodies, between them holding every kind of content part and of prompt."""

    def chat(part: dict) -> dict:
        return {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": [part]}]}

    return {
        "/v1/chat/completions": [
            {**chat({"type": "text", "text": "hi"}), "stream": True, "stream_options": {"include_usage": True}},
            chat({"type": "image_url", "image_url": {"url": SMALL_PNG}}),
            chat({"type": "image", "image": SMALL_PNG}),
            chat({"type": "video_url", "video_url": {"url": NOT_A_VIDEO}}),  # options are checked first
            chat({"type": "video", "video": [SMALL_PNG, SMALL_PNG]}),
        ],
        "/v1/completions": [
            {"model": model, "max_tokens": 1, "prompt": "hi"},
            {"model": model, "max_tokens": 1, "prompt": [1, 2, 3]},
            {"model": model, "max_tokens": 1, "prompt": ["a", "b"]},
            {"model": model, "max_tokens": 1, "prompt": [[1, 2], [3]]},
        ],
    }


# OpenAI's fields that the schema does not name (the server ignores them): whatever they hold.
UNNAMED_FIELDS = ("logit_bias", "response_format", "tools", "tool_choice", "presence_penalty")


def _cases(raw: dict, model: str) -> list[tuple[str, FieldPath, dict]]:
    """(endpoint, field, base body): each field the schema names, with the first base body in
    whose shape it is, and UNNAMED_FIELDS."""
    cases: dict[tuple[str, FieldPath], dict] = {}
    for endpoint, bases in _bases(model).items():
        request = raw["paths"][endpoint]["post"]["requestBody"]["content"]["application/json"]["schema"]
        for base in bases:
            for path in [*_fields(request, base, raw), *((name,) for name in UNNAMED_FIELDS)]:
                cases.setdefault((endpoint, path), base)
    return [(endpoint, path, base) for (endpoint, path), base in cases.items()]


@pytest.mark.slow
def test_every_field_at_every_extreme_gets_an_answer_or_a_4xx(server: Server, served_model: str) -> None:
    engine = server.engine_pid()
    cases = _cases(server.get("/openapi.json").json(), served_model)
    # Both endpoints' top-level fields and the messages' content parts are all reached.
    fields = {(endpoint, path) for endpoint, path, _ in cases}
    assert ("/v1/chat/completions", ("messages", 0, "content", 0, "video_url", "url")) in fields
    assert ("/v1/chat/completions", ("stream_options", "include_usage")) in fields
    assert ("/v1/completions", ("prompt", 0, 0)) in fields
    headers = {**server.headers, "content-type": "application/json"}

    def send(client: httpx.Client, endpoint: str, path: FieldPath, base: dict, value: object) -> str | None:
        body = _with(base, path, value)
        _bounded(body, None)  # a model name other than the served one: 404
        try:
            answered_well(client.post(endpoint, content=_encoded(body)), None)
        except (AssertionError, httpx.HTTPError, KeyError, ValueError) as e:
            return f"{endpoint} {path} = {value!r:.60}: {e!r:.300}"
        return None

    # A few at a time, as clients do: the engine batches valid requests beside refused ones.
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client, ThreadPoolExecutor(4) as pool:
        jobs = [(client, *case, value) for case in cases for value in EXTREMES]
        failures = [f for f in pool.map(lambda job: send(*job), jobs) if f]
    assert not failures, f"{len(failures)} of {len(jobs)} failed:\n" + "\n".join(failures[:30])
    assert server.engine_pid() == engine and server.health() == 200
    assert not segments_left()


# -- what the fuzz found -------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stop", ["\ud800", ["ok", "a\x00"]])
def test_stop_strings_the_engine_cannot_take_are_refused_naming_stop(
    server: Server, served_model: str, endpoint: str, stream: bool, stop: object
) -> None:
    """A lone surrogate cannot be encoded to go to the engine: it was a 500, or a stream cut off."""
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in endpoint else {"prompt": "hi"}
    body = {"model": served_model, "max_tokens": 2, "stream": stream, "stop": stop, **prompt}
    headers = {**server.headers, "content-type": "application/json"}
    response = httpx.post(server.url + endpoint, content=json.dumps(body), headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stop" and ("lone surrogate" in error["message"] or "NUL" in error["message"])


def test_a_wrong_method_is_the_clients_error(server: Server) -> None:
    response = server.get("/v1/chat/completions")
    assert response.status_code == 405
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_the_published_bounds_are_the_servers(server: Server, served_model: str) -> None:
    """The schema's smallest top_p and sample_fps are accepted and the next float below refused
    (top_p was published as "> 0", sample_fps as "> 0 up to 1e12"); a video's fps and nframes are
    published as exclusive, as the server has them."""
    raw = server.get("/openapi.json").json()
    chat = raw["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    top_p = chat["top_p"]["anyOf"][0]["minimum"]
    parts = chat["messages"]["items"]["properties"]["content"]["anyOf"][1]["items"]["anyOf"]
    video = next(p for p in parts if p.get("properties", {}).get("type", {}).get("const") == "video")
    sample_fps = video["properties"]["sample_fps"]
    assert video["not"] == {"required": ["fps", "nframes"]}

    def status(part: dict | None = None, **extra: object) -> int:
        content = [part] if part else "hi"
        body = {"model": served_model, "max_tokens": 1, "messages": [{"role": "user", "content": content}], **extra}
        return server.post("/v1/chat/completions", body).status_code

    assert (status(top_p=top_p), status(top_p=math.nextafter(top_p, 0))) == (200, 400)
    frames = {"type": "video", "video": [SMALL_PNG, SMALL_PNG]}
    for bound, past in (("minimum", -math.inf), ("maximum", math.inf)):
        fps = sample_fps[bound]
        assert status({**frames, "sample_fps": fps}) == 200, fps
        assert status({**frames, "sample_fps": math.nextafter(fps, past)}) == 400, fps
    assert status({**frames, "fps": 1, "nframes": 2}) == 400
