"""A web page the user visits cannot drive the server on their machine, and /tokenize waits its turn.

As a browser would send them, from a page at http://evil.example: a "simple" cross-site POST
(text/plain, form-urlencoded, no Content-Type at all: no preflight needed) gets 415 before its
body is read; a DNS-rebound page (its own domain as Host) gets 400; no Access-Control-* header is
ever sent unless --allowed-origins names the origin. The default server has no API key, as a user
starts it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import Server, start_server

EVIL = "http://evil.example"
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def open_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default: no API key, bound to 127.0.0.1, with a queue of 1 (for /tokenize)."""
    s = start_server(tiny_dir, tmp_path_factory.mktemp("guard"), "--max-queue", "1", api_key=None)
    yield s
    s.stop()


@pytest.mark.parametrize(
    "content_type",
    ["text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
@pytest.mark.parametrize("path", ["/invocations", "/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_a_cross_site_simple_post_is_refused(open_server: Server, path: str, content_type: str | None) -> None:
    import json

    headers = {"Origin": EVIL, "Host": open_server.url.removeprefix("http://")}
    if content_type is not None:
        headers["Content-Type"] = content_type
    body = json.dumps({**CHAT, "prompt": "hello"} if "completions" in path and "chat" not in path else CHAT)
    response = httpx.post(open_server.url + path, content=body.encode(), headers=headers, timeout=30)
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert not any(name.lower().startswith("access-control-") for name in response.headers)


def test_json_still_works_and_no_cors_header_is_sent(open_server: Server) -> None:
    response = httpx.post(open_server.url + "/invocations", json=CHAT, headers={"Origin": EVIL}, timeout=60)
    assert response.status_code == 200, response.text
    assert not any(name.lower().startswith("access-control-") for name in response.headers)
    # a charset parameter and application/*+json are JSON too
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        response = httpx.post(
            open_server.url + "/v1/chat/completions",
            content=httpx.Request("POST", "/", json=CHAT).content,
            headers={"Content-Type": content_type},
            timeout=60,
        )
        assert response.status_code == 200, (content_type, response.text)
    # the preflight a page needs before a JSON POST is not granted
    preflight = httpx.options(
        open_server.url + "/v1/chat/completions",
        headers={
            "Origin": EVIL,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
        timeout=10,
    )
    assert "access-control-allow-origin" not in preflight.headers


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil"])
def test_a_rebound_page_s_host_is_refused(open_server: Server, host: str) -> None:
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/")):
        response = httpx.request(
            method, open_server.url + path, json=CHAT if method == "POST" else None, headers={"Host": host}, timeout=30
        )
        assert response.status_code == 400, (method, path, response.text)
        error = response.json()["error"]
        assert error["code"] == "invalid_host" and "--allowed-hosts" in error["message"] and host in error["message"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "LOCALHOST:{port}", "127.0.0.1:{port}", "[::1]:{port}"])
def test_the_server_s_own_names_are_served(open_server: Server, host: str) -> None:
    port = open_server.url.rsplit(":", 1)[1]
    response = httpx.get(open_server.url + "/v1/models", headers={"Host": host.format(port=port)}, timeout=10)
    assert response.status_code == 200, response.text


def test_allowed_hosts_and_origins_are_given_by_flags(tiny_dir: Path, tmp_path: Path) -> None:
    s = start_server(
        tiny_dir,
        tmp_path,
        "--allowed-hosts",
        "api.example",
        "--allowed-origins",
        "https://app.example",
        '["https://other.example"]',
        api_key=None,
    )
    try:
        assert httpx.get(s.url + "/v1/models", headers={"Host": "api.example"}, timeout=10).status_code == 200
        assert httpx.get(s.url + "/v1/models", headers={"Host": "evil.example"}, timeout=10).status_code == 400
        for origin, allowed in (("https://app.example", True), ("https://other.example", True), (EVIL, False)):
            preflight = httpx.options(
                s.url + "/v1/chat/completions",
                headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
                timeout=10,
            )
            assert (preflight.headers.get("access-control-allow-origin") == origin) == allowed, preflight.headers
            response = httpx.post(s.url + "/v1/chat/completions", json=CHAT, headers={"Origin": origin}, timeout=60)
            assert response.status_code == 200
            assert (response.headers.get("access-control-allow-origin") == origin) == allowed
    finally:
        s.stop()


def test_a_bad_allowed_origins_value_is_a_usage_error() -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "vlmserve.entrypoints.cli", "serve", "--allowed-origins", "[1, 2]"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--allowed-origins: '[1, 2]' is neither an origin nor a JSON list of origins" in result.stderr


def test_tokenize_counts_against_the_queue(open_server: Server) -> None:
    """With --max-queue 1 and a request in flight, /tokenize (which fetches and processes images)
    is a 429 like any other; once the queue is free it is answered again."""
    url = open_server.url
    started = threading.Event()
    done: list[int] = []

    def long_request() -> None:
        body = {**CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
            for _ in response.iter_lines():
                started.set()
        done.append(response.status_code)

    worker = threading.Thread(target=long_request)
    worker.start()
    try:
        assert started.wait(120)
        tokenize = {"model": "tiny", "prompt": "hello"}
        response = httpx.post(url + "/tokenize", json=tokenize, timeout=30)
        assert response.status_code == 429, response.text
        assert "limit of 1 requests" in response.json()["error"]["message"]
    finally:
        worker.join(300)
    assert done == [200]
    response = httpx.post(url + "/tokenize", json=tokenize, timeout=30)
    assert response.status_code == 200 and response.json()["count"] > 0
    assert open_server.health() == 200
