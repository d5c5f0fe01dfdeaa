"""Property-based fuzzing of the request bodies: whatever arrives, never a 5xx, and every 4xx
comes in OpenAI's error shape (BAD_INPUTS 29)."""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serve.conftest import Server

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


def _short(body: dict, *keys: str) -> None:
    """Valid bodies generate a few tokens, not up to the context limit (the default)."""
    for key in keys:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 3:
            body[key] = 3
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
