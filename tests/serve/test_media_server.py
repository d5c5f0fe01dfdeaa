"""BAD_INPUTS 2-6 against real servers: one that trusts a test HTTP server's port and a local
media folder (as an operator might), one restricted to an allowed-domains list."""

from __future__ import annotations

import gzip
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from tests.serve.conftest import Server, data_url, image_message, picture, start_server
from tests.serve.test_bad_inputs import chat, check_error

PNG = picture(8, size=(64, 48))


class Upstream(http.server.BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []  # each subclass gets its own list
    png = b""

    def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
        pass

    def do_GET(self) -> None:
        self.hits.append(self.path)
        if self.path == "/ok.png":
            self._send(200, self.png)
        elif self.path.startswith("/to/"):
            self._send(302, b"", {"Location": self.path.removeprefix("/to/")})
        elif self.path == "/loop":
            self._send(302, b"", {"Location": "/loop"})
        elif self.path in ("/404", "/403"):
            self._send(int(self.path[1:]), b"no")
        elif self.path == "/500":
            self._send(500, b"oops")
        elif self.path == "/huge":
            self.send_response(200)
            self.send_header("Content-Length", str(10**12))
            self.end_headers()
        elif self.path == "/bomb":
            self._send(200, gzip.compress(b"\0" * (100 << 20)), {"Content-Encoding": "gzip"})
        elif self.path == "/drip":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.5)
            except (BrokenPipeError, ConnectionResetError):
                pass
        else:
            self._send(404, b"")

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _serve(handler: type) -> http.server.ThreadingHTTPServer:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[int, int, list[str]]]:
    """(trusted port, untrusted port, hits of the untrusted one)."""
    import io

    buf = io.BytesIO()
    PNG.save(buf, format="PNG")
    trusted = _serve(type("Trusted", (Upstream,), {"hits": [], "png": buf.getvalue()}))
    untrusted_hits: list[str] = []
    untrusted = _serve(type("Untrusted", (Upstream,), {"hits": untrusted_hits, "png": buf.getvalue()}))
    yield trusted.server_address[1], untrusted.server_address[1], untrusted_hits
    trusted.shutdown()
    untrusted.shutdown()


@pytest.fixture(scope="module")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    PNG.save(root / "allowed" / "a.png")
    PNG.save(root / "outside.png")
    (root / "allowed" / "link.png").symlink_to(root / "outside.png")
    return root


@pytest.fixture(scope="module")
def open_server(
    tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory, upstream, media_root: Path
) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    trusted, _, _ = upstream
    s = start_server(
        tiny_dir,
        tmp_path_factory.mktemp("open"),
        "--allow-media-network",
        f"127.0.0.1/32:{trusted}",
        "--allowed-local-media-path",
        str(media_root / "allowed"),
        "--max-media-bytes",
        "1048576",
    )
    yield s
    s.stop()


def test_trusted_media_is_served(open_server: Server, upstream, media_root: Path) -> None:  # type: ignore[no-untyped-def]
    trusted, _, _ = upstream
    expected = chat(open_server, image_message(data_url(PNG))).json()["choices"][0]["message"]["content"]
    for url in (
        f"http://127.0.0.1:{trusted}/ok.png",
        (media_root / "allowed" / "a.png").as_uri(),
        str(media_root / "allowed" / "a.png"),
    ):
        response = chat(open_server, image_message(url))
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == expected


def test_redirects_to_untrusted_addresses_are_refused_at_the_hop(open_server: Server, upstream) -> None:  # type: ignore[no-untyped-def]
    trusted, untrusted, hits = upstream
    before = len(hits)
    url = f"http://127.0.0.1:{trusted}/to/http://127.0.0.1:{untrusted}/ok.png"
    check_error(open_server, chat(open_server, image_message(url)), 400, "private, loopback or reserved")
    assert len(hits) == before
    start = time.monotonic()
    check_error(
        open_server, chat(open_server, image_message(f"http://127.0.0.1:{trusted}/loop")), 400, "more than 3 redirects"
    )
    assert time.monotonic() - start < 3


@pytest.mark.parametrize(
    ("path", "status_code", "match", "code"),
    [
        ("/404", 400, "answered 404", "invalid_media_url"),
        ("/403", 400, "answered 403", "invalid_media_url"),
        ("/500", 400, "failed \\(500\\)", "media_upstream_error"),
        ("/huge", 400, "over the 1048576-byte limit", "media_too_large"),
        ("/bomb", 400, "over the 1048576-byte limit", "media_too_large"),
        ("/drip", 400, "timed out after 2s", "media_fetch_timeout"),
    ],
)
def test_upstream_failures(open_server: Server, upstream, path: str, status_code: int, match: str, code: str) -> None:  # type: ignore[no-untyped-def]
    trusted, _, _ = upstream
    error = check_error(
        open_server, chat(open_server, image_message(f"http://127.0.0.1:{trusted}{path}")), status_code, match
    )
    assert error["code"] == code


@pytest.mark.parametrize(
    "relative",
    ["../outside.png", "%2e%2e/outside.png", "link.png", "missing.png"],
)
def test_local_files_cannot_escape_the_allowed_folder(open_server: Server, media_root: Path, relative: str) -> None:
    allowed = media_root / "allowed"
    for url in (f"{allowed}/{relative}", f"file://{allowed}/{relative}"):
        error = check_error(open_server, chat(open_server, image_message(url)), 400)
        # Forbidden and missing read the same.
        assert "file not found or not allowed" in error["message"]
    check_error(
        open_server, chat(open_server, image_message("/proc/self/environ")), 400, "file not found or not allowed"
    )


@pytest.fixture(scope="module")
def domains_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tiny_dir, tmp_path_factory.mktemp("domains"), "--allowed-media-domains", "images.example.com")
    yield s
    s.stop()


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("http://images.example.com@127.0.0.1/x.png", "user info"),
        ("http://127.0.0.1\\@images.example.com/x.png", "characters URLs may not"),
        ("http://images.example.com.evil.test/x.png", "not in the allowed domains"),
        ("http://evil-images.example.com/x.png", "not in the allowed domains"),
        ("http://іmages.example.com/x.png", "not in the allowed domains"),
        ("http://127.0.0.1/x.png", "not in the allowed domains"),
        ("http://IMAGES.EXAMPLE.COM.:8080/x.png", "could not be resolved"),  # allowed; offline here
    ],
)
def test_url_tricks_cannot_escape_the_allowed_domains(domains_server: Server, url: str, match: str) -> None:
    check_error(domains_server, chat(domains_server, image_message(url)), 400, match)
