"""The media fetcher against real HTTP servers on loopback (reachable only where a policy
allows one port explicitly, as an operator might allow an internal image store)."""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Iterator

import pytest

from tests.api.upstream import PNG, serve
from vlmserve.api.fetch import FetchError, FetchPolicy, fetch


@pytest.fixture(scope="module")
def allowed() -> Iterator[tuple[int, list[str]]]:
    server, hits = serve()
    yield server.server_address[1], hits
    server.shutdown()


@pytest.fixture(scope="module")
def forbidden() -> Iterator[tuple[int, list[str]]]:
    server, hits = serve()
    yield server.server_address[1], hits
    server.shutdown()


def _policy(port: int, **kwargs) -> FetchPolicy:  # type: ignore[no-untyped-def]
    return FetchPolicy(allowed_networks=((ipaddress.ip_network("127.0.0.1/32"), port),), **kwargs)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_fetches_where_allowed(allowed) -> None:  # type: ignore[no-untyped-def]
    port, _ = allowed
    assert run(fetch(f"http://127.0.0.1:{port}/ok.png", _policy(port))) == PNG


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "[::1]",
        "2130706433",
        "0x7f000001",
        "0177.0.0.1",
        "127.1",
        "[::ffff:127.0.0.1]",
        "localhost",
        "169.254.169.254",
        "10.0.0.1",
        "172.16.5.4",
        "192.168.0.1",
        "100.64.0.1",
        "0.0.0.0",
        "[fe80::1]",
    ],
)
def test_private_addresses_in_every_spelling_are_refused_without_a_hit(forbidden, host: str) -> None:  # type: ignore[no-untyped-def]
    port, hits = forbidden
    before = len(hits)
    with pytest.raises(FetchError, match="private, loopback or reserved|could not be resolved"):
        run(fetch(f"http://{host}:{port}/ok.png", FetchPolicy(timeout_s=3)))
    assert len(hits) == before


def test_redirects_are_checked_at_every_hop(allowed, forbidden) -> None:  # type: ignore[no-untyped-def]
    port, _ = allowed
    other, other_hits = forbidden
    before = len(other_hits)
    with pytest.raises(FetchError, match="private, loopback or reserved"):
        run(fetch(f"http://127.0.0.1:{port}/to/http://127.0.0.1:{other}/ok.png", _policy(port)))
    assert len(other_hits) == before
    start = time.monotonic()
    with pytest.raises(FetchError, match="more than 3 redirects"):
        run(fetch(f"http://127.0.0.1:{port}/loop", _policy(port)))
    assert time.monotonic() - start < 2


def test_the_resolved_address_is_pinned(allowed) -> None:  # type: ignore[no-untyped-def]
    port, _ = allowed
    calls: list[str] = []

    async def rebinding(host: str, _port: int) -> list[str]:
        calls.append(host)
        # First answer: the allowed address; any later answer would point elsewhere.
        return ["127.0.0.1"] if len(calls) == 1 else ["10.9.9.9"]

    body = run(fetch(f"http://images.example.test:{port}/ok.png", _policy(port, resolve=rebinding)))
    assert body == PNG and calls == ["images.example.test"]


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://images.example.com@127.0.0.1/x.png", "user info"),
        ("http://127.0.0.1\\@images.example.com/x.png", "characters URLs may not"),
        ("http://images.example.com.evil.test/x.png", "not in the allowed domains"),
        ("http://evil-images.example.com/x.png", "not in the allowed domains"),
        ("http://іmages.example.com/x.png", "not in the allowed domains"),  # Cyrillic і
        ("ftp://images.example.com/x.png", "only http and https"),
        ("file:///etc/passwd", "only http and https"),
        ("http://images.example.com:99999/x.png", "malformed"),
    ],
)
def test_url_tricks_cannot_escape_the_allowed_domains(url: str, message: str) -> None:
    async def resolve(host: str, port: int) -> list[str]:
        return ["93.184.216.34"]

    with pytest.raises(FetchError, match=message):
        run(fetch(url, FetchPolicy(allowed_domains=("images.example.com",), resolve=resolve, timeout_s=2)))


def test_allowed_domain_spellings_pass_the_list(allowed) -> None:  # type: ignore[no-untyped-def]
    port, _ = allowed

    async def resolve(host: str, _port: int) -> list[str]:
        assert host == "images.example.com"  # normalised: lower case, no trailing dot
        return ["127.0.0.1"]

    policy = _policy(port, allowed_domains=("Images.Example.com",), resolve=resolve)
    assert run(fetch(f"http://IMAGES.example.COM.:{port}/ok.png", policy)) == PNG


def test_upstream_errors_are_told_apart(allowed) -> None:  # type: ignore[no-untyped-def]
    port, _ = allowed
    with pytest.raises(FetchError, match="answered 404") as missing:
        run(fetch(f"http://127.0.0.1:{port}/status/404", _policy(port)))
    assert missing.value.code == "invalid_media_url"
    with pytest.raises(FetchError, match="failed \\(500\\)") as broken:
        run(fetch(f"http://127.0.0.1:{port}/status/500", _policy(port)))
    assert broken.value.code == "media_upstream_error"


def test_byte_caps_and_timeouts(allowed) -> None:  # type: ignore[no-untyped-def]
    port, _ = allowed
    policy = _policy(port, max_bytes=1024 * 1024, timeout_s=2)
    for path in ("huge", "endless", "bomb"):
        with pytest.raises(FetchError, match="over the 1048576-byte limit") as e:
            run(fetch(f"http://127.0.0.1:{port}/{path}", policy))
        assert e.value.code == "media_too_large"
    start = time.monotonic()
    with pytest.raises(FetchError, match="timed out after 2s") as e:
        run(fetch(f"http://127.0.0.1:{port}/drip", policy))
    assert e.value.code == "media_fetch_timeout" and time.monotonic() - start < 4
