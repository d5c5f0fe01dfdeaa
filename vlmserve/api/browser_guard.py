"""What keeps a web page the user happens to visit from driving a server on their machine.

A browser lets any page send a "simple" cross-site POST (Content-Type text/plain, form-urlencoded,
multipart, or none) without asking the server first, and a page whose domain is re-pointed at
127.0.0.1 (DNS rebinding) can read the answers as its own. Three rules close both:

- JSON only: a POST with a body (every POST route takes JSON) must say `Content-Type:
  application/json` (anything JSON, `application/...+json` too), else 415 before its body is
  read. A browser cannot send that cross-site without a CORS preflight, which the server does
  not grant (next rule).
- No CORS unless asked: no Access-Control-* headers at all by default; `--allowed-origins`
  names the origins that may call the API from a page (vLLM's flag; `*` for any).
- Host allow-list: a request's Host header must name this server: localhost, 127.0.0.1, ::1 and
  the address it was bound to, plus `--allowed-hosts` (`*`: any). A page that rebinds its own
  domain to 127.0.0.1 still sends its domain as Host, and gets 400. Bound to every interface
  (0.0.0.0 or ::) the names clients use cannot be known, so the check is off unless
  `--allowed-hosts` is given (the start-up log says so).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from vlmserve.errors import APIError, send_error

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]
Send = Callable[[Any], Awaitable[None]]

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")


def allowed_hosts(bind_host: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The Host names (without port, lower case) requests may give; None: any."""
    extra = [host.lower().strip("[]") for host in extra]
    if "*" in extra:
        return None
    if bind_host in WILDCARD_BINDS and not extra:
        return None
    return frozenset([*LOCAL_HOSTS, bind_host.lower().strip("[]"), *extra]) - {""}


def host_name(header: str) -> str:
    """A Host header's name: `[::1]:8000` -> `::1`, `Example.com:80` -> `example.com`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    name, _, port = header.rpartition(":")
    if name and port.isdigit():
        header = name
    try:  # a bare IPv6 address without brackets (not a valid Host, but unambiguous)
        return str(ipaddress.IPv6Address(header))
    except ValueError:
        return header


def _header(scope: Scope, name: bytes) -> list[bytes]:
    return [value for key, value in scope.get("headers", []) if key == name]


def host_check(app: ASGIApp, hosts: frozenset[str] | None) -> ASGIApp:
    """400 for a request whose Host is not one of `hosts` (None: no check)."""
    if hosts is None:
        return app

    async def middleware(scope: Scope, receive: Callable[[], Awaitable[Any]], send: Send) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        given = _header(scope, b"host")
        name = host_name(given[0].decode("latin-1")) if len(given) == 1 else None
        if name not in hosts:
            shown = "none" if not given else "several" if len(given) > 1 else repr(given[0].decode("latin-1"))
            message = (
                f"Host header {shown} does not name this server (it answers to {', '.join(sorted(hosts))}); "
                "a server reached under another name needs --allowed-hosts NAME"
            )
            return await send_error(send, APIError(400, message, code="invalid_host"))
        return await app(scope, receive, send)

    return middleware


def is_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def _has_body(scope: Scope) -> bool:
    lengths = _header(scope, b"content-length")
    return bool(_header(scope, b"transfer-encoding")) or any(length.strip() not in (b"", b"0") for length in lengths)


def json_only(app: ASGIApp) -> ASGIApp:
    """415 for a POST with a body (every POST route takes JSON; /ping takes none) whose
    Content-Type is not JSON, or missing."""

    async def middleware(scope: Scope, receive: Callable[[], Awaitable[Any]], send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not _has_body(scope):
            return await app(scope, receive, send)
        given = _header(scope, b"content-type")
        if len(given) != 1 or not is_json(given[0]):
            shown = "none" if not given else "several" if len(given) > 1 else repr(given[0].decode("latin-1"))
            message = f"the request body must be JSON with Content-Type: application/json (got {shown})"
            return await send_error(send, APIError(415, message, code="unsupported_media_type"))
        return await app(scope, receive, send)

    return middleware


def cors(app: ASGIApp, origins: list[str]) -> ASGIApp:
    """Starlette's CORS handling for `origins` (none: no CORS headers, preflights refused)."""
    if not origins:
        return app
    from starlette.middleware.cors import CORSMiddleware

    return CORSMiddleware(  # type: ignore[return-value]
        app,  # type: ignore[arg-type]
        allow_origins=origins,
        allow_methods=["GET", "POST", "OPTIONS"],
        allow_headers=["Authorization", "Content-Type"],
        max_age=600,
    )


def origins(value: str) -> list[str]:
    """One --allowed-origins value: an origin, or vLLM's JSON list of them ('["https://a.example"]')."""
    if not value.lstrip().startswith("["):
        return [value]
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(origin, str) for origin in parsed):
        raise argparse.ArgumentTypeError(f"{value!r} is neither an origin nor a JSON list of origins")
    return parsed
