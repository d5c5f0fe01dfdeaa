"""BAD_INPUTS 2-6 against real servers: one that trusts a test HTTP server's port and a local
media folder (as an operator might), one restricted to an allowed-domains list."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.conftest import Server, data_url, image_message, picture, start_server
from tests.api.test_bad_inputs import chat, check_error
from tests.api.upstream import serve

PNG = picture(8, size=(64, 48))


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[int, int, list[str]]]:
    """(trusted port, untrusted port, hits of the untrusted one)."""
    buf = io.BytesIO()
    PNG.save(buf, format="PNG")
    trusted, _ = serve(buf.getvalue(), drip_interval=0.5)
    untrusted, untrusted_hits = serve(buf.getvalue())
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
        ("/status/404", 400, "answered 404", "invalid_media_url"),
        ("/status/403", 400, "answered 403", "invalid_media_url"),
        ("/status/500", 400, "failed \\(500\\)", "media_upstream_error"),
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
