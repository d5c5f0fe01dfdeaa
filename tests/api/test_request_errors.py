"""Issue 13, items 5 and 6: whatever goes wrong while a request's prompt is rendered, tokenized or
processed is a 400 naming the field (never a 500, never Python's own words), and a prompt too long
for max_model_len is refused before it is tokenized, without stalling the event loop. Each test
also checks that the engine process kept its PID and no /dev/shm segment is left."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.api.conftest import Server
from tests.api.test_bad_inputs import check_error

HUGE = 24 * 1024 * 1024  # inside the default 32 MiB body cap


def chat(server: Server, messages: list, **extra) -> httpx.Response:  # type: ignore[no-untyped-def]
    return server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2, **extra})


HISTORY = [
    {"role": "user", "content": "one"},
    {"role": "assistant", "content": "two"},
    {"role": "user", "content": "three"},
]


def greedy(server: Server, prompt: str) -> list[str]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def test_chat_template_kwargs_naming_the_templates_own_arguments_get_400_naming_the_key(server: Server) -> None:
    engine = server.engine_pid()
    for key in ("messages", "add_generation_prompt", "bos_token", "eos_token"):
        response = chat(server, HISTORY, chat_template_kwargs={key: 1})
        check_error(server, response, 400, f"chat_template_kwargs.*{key}")
    assert server.engine_pid() == engine


def test_qwen_vl_system_or_max_window_size_of_the_wrong_type_get_400_naming_the_key(qwen_server: Server) -> None:
    engine = qwen_server.engine_pid()
    for kwargs, key in (
        ({"system": 5}, "system"),
        ({"system": ["a"]}, "system"),
        ({"max_window_size": "x"}, "max_window_size"),
        ({"max_window_size": 1.5}, "max_window_size"),
        ({"max_window_size": True}, "max_window_size"),
    ):
        response = chat(qwen_server, HISTORY, chat_template_kwargs=kwargs)
        check_error(qwen_server, response, 400, f"chat_template_kwargs.{key}")
    assert qwen_server.engine_pid() == engine


def test_qwen_vl_box_with_infinity_or_nan_gets_400_naming_the_box(qwen_server: Server) -> None:
    engine = qwen_server.engine_pid()
    # JSON has no Infinity; Python's json (and so the server) reads it, as does 1e400.
    for value in ("Infinity", "-Infinity", "NaN", "1e400"):
        raw = (
            '{"max_tokens": 2, "messages": [{"role": "user", "content": '
            f'[{{"text": "where?"}}, {{"ref": "cat", "box": [0, 0, {value}, 10]}}]}}]}}'
        )
        response = qwen_server.post(
            "/v1/chat/completions", content=raw.encode(), headers={"Content-Type": "application/json"}
        )
        check_error(qwen_server, response, 400, "box")
    assert qwen_server.engine_pid() == engine


def test_qwen_vl_img_spans_too_long_or_unclosed_get_400_and_requests_in_flight_keep_their_tokens(
    qwen_server: Server,
) -> None:
    engine = qwen_server.engine_pid()
    alone = greedy(qwen_server, "Tell me a story")
    results: list[list[str]] = []
    worker = threading.Thread(target=lambda: results.extend(greedy(qwen_server, "Tell me a story") for _ in range(3)))
    worker.start()
    try:
        for prompt, match in (
            ("<img>" + "a" * 300 + "</img>\nWhat?", "256 bytes"),
            ("<img>/no/end\nWhat?", "unclosed <img>"),
            ("What?</img>", "closes no <img>"),
        ):
            response = qwen_server.post("/v1/completions", {"prompt": prompt, "max_tokens": 2})
            check_error(qwen_server, response, 400, match)
            response = chat(qwen_server, [{"role": "user", "content": prompt}])
            check_error(qwen_server, response, 400, match)
    finally:
        worker.join()
    assert results == [alone] * 3
    assert qwen_server.engine_pid() == engine


def _huge_request_with_health_probes(server: Server, path: str, body: bytes) -> httpx.Response:
    """Sends `body` from a thread and probes /health until its answer comes: every probe must be
    answered (5 s each, against the milliseconds it takes) while the big request is handled."""
    answer: list[httpx.Response] = []

    def send() -> None:
        answer.append(
            httpx.post(
                server.url + path,
                content=body,
                headers={**server.headers, "Content-Type": "application/json"},
                timeout=300,
            )
        )

    sender = threading.Thread(target=send)
    sender.start()
    try:
        while sender.is_alive():
            assert server.health() == 200, "/health did not answer while the big request was handled"
    finally:
        sender.join()
    return answer[0]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_prompt_too_long_for_max_model_len_gets_400_naming_it_and_health_answers_meanwhile(
    server: Server, endpoint: str
) -> None:
    engine = server.engine_pid()
    text = "hello world " * (HUGE // 12)
    if endpoint == "completions":
        path, body = "/v1/completions", b'{"max_tokens": 2, "prompt": "' + text.encode() + b'"}'
    else:
        path = "/v1/chat/completions"
        body = b'{"max_tokens": 2, "messages": [{"role": "user", "content": "' + text.encode() + b'"}]}'
    response = _huge_request_with_health_probes(server, path, body)
    check_error(server, response, 400, "max_model_len=4096")
    assert server.engine_pid() == engine


def test_qwen_vl_prompt_too_long_for_max_model_len_gets_400_and_health_answers_meanwhile(
    qwen_server: Server,
) -> None:
    engine = qwen_server.engine_pid()
    text = ("hello world " * (HUGE // 12)).encode()
    for path, body in (
        ("/v1/completions", b'{"max_tokens": 2, "prompt": "' + text + b'"}'),
        (
            "/v1/chat/completions",
            b'{"max_tokens": 2, "messages": [{"role": "user", "content": [{"text": "' + text + b'"}]}]}',
        ),
    ):
        response = _huge_request_with_health_probes(qwen_server, path, body)
        check_error(qwen_server, response, 400, "max_model_len=4096")
    assert qwen_server.engine_pid() == engine
