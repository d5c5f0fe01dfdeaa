"""Fetching media URLs for the server without becoming a way into the network behind it.

- Only http and https. No user-info, backslashes, whitespace or control characters in a URL.
- The host is normalised (case, trailing dot, IDNA) before it is checked against the
  allowed-domains list, when one is set.
- Every address the host resolves to must be globally routable (IPv4-mapped, 6to4 and Teredo
  IPv6 addresses are checked by the IPv4 address inside); an operator may allow private networks
  explicitly. The connection then goes to that resolved address (the host rides along as the
  Host header and TLS server name), so a second DNS answer cannot point it elsewhere.
- Redirects are followed by hand, at most `max_redirects`, each hop checked the same way.
- A byte cap on the body as decoded (a gzip bomb stops at the cap), and one deadline for the
  whole fetch, redirects and a dripping server included.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import urllib.parse
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[list[str]]]


class FetchError(ValueError):
    """A media URL that cannot be used; `code` tells the client which kind of failure."""

    def __init__(self, message: str, code: str = "invalid_media_url") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class FetchPolicy:
    allowed_domains: tuple[str, ...] = ()  # empty: any public host
    # Private networks an operator trusts, each with an optional port: (network, port or None).
    allowed_networks: tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, int | None], ...] = ()
    max_bytes: int = 20 * 1024 * 1024
    timeout_s: float = 10.0
    max_redirects: int = 3
    resolve: Resolver | None = field(default=None, compare=False)  # None: the system resolver


def normalize_host(host: str) -> str:
    host = host.strip().rstrip(".").lower()
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError:
        raise FetchError("the URL's host name is not valid") from None


def domain_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    if not allowed:
        return True
    return any(host == d or host.endswith("." + d) for d in (normalize_host(a) for a in allowed))


def _embedded_v4(ip: IPAddress) -> IPAddress:
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip.sixtofour is not None:
            return ip.sixtofour
        if ip.teredo is not None:
            return ip.teredo[1]
    return ip


def address_allowed(ip: IPAddress, port: int, policy: FetchPolicy) -> bool:
    inner = _embedded_v4(ip)
    # An IPv4-mapped address is its IPv4 address; 6to4 and Teredo must be global both ways.
    candidates = [inner] if inner is not ip and ip.ipv4_mapped is not None else [ip, inner]  # type: ignore[union-attr]
    if all(c.is_global and not c.is_multicast for c in candidates):
        return True
    return any(inner in net and (p is None or p == port) for net, p in policy.allowed_networks)


async def _system_resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


@dataclass(frozen=True)
class _Target:
    url: str  # with the pinned address in place of the host
    host: str
    scheme: str


async def _check(url: str, policy: FetchPolicy, label: str) -> _Target:
    if any(c in url for c in "\\\r\n\t ") or any(ord(c) < 32 for c in url):
        raise FetchError(f"{label}: the URL holds characters URLs may not")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise FetchError(f"{label}: the URL is malformed") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise FetchError(f"{label}: only http and https URLs are fetched")
    if "@" in parts.netloc:
        raise FetchError(f"{label}: URLs with user info are not fetched")
    if not parts.hostname:
        raise FetchError(f"{label}: the URL has no host")
    host = normalize_host(parts.hostname)
    if not domain_allowed(host, policy.allowed_domains):
        raise FetchError(f"{label}: the URL's host is not in the allowed domains")
    port = port or (443 if scheme == "https" else 80)
    try:
        answers = await (policy.resolve or _system_resolve)(host, port)
        addresses = [ipaddress.ip_address(a.split("%")[0]) for a in answers]
    except (OSError, ValueError):
        raise FetchError(f"{label}: the URL's host could not be resolved") from None
    if not addresses or not all(address_allowed(ip, port, policy) for ip in addresses):
        raise FetchError(f"{label}: the URL points at a private, loopback or reserved address")
    pinned = addresses[0]
    literal = f"[{pinned}]" if pinned.version == 6 else str(pinned)
    path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    return _Target(f"{scheme}://{literal}:{port}{path}", host if parts.port is None else f"{host}:{parts.port}", scheme)


async def fetch(url: str, policy: FetchPolicy, label: str = "image_url") -> bytes:
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _fetch(url, policy, label)
    except TimeoutError:
        raise FetchError(
            f"{label}: fetching the URL timed out after {policy.timeout_s:g}s", "media_fetch_timeout"
        ) from None


async def _fetch(url: str, policy: FetchPolicy, label: str) -> bytes:
    limits = httpx.Timeout(policy.timeout_s)
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=limits) as client:
        for _ in range(policy.max_redirects + 1):
            target = await _check(url, policy, label)
            extensions = {"sni_hostname": target.host.split(":")[0]} if target.scheme == "https" else {}
            request = client.build_request(
                "GET",
                target.url,
                headers={"Host": target.host, "Accept-Encoding": "gzip, deflate, identity"},
                extensions=extensions,
            )
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as e:
                raise FetchError(
                    f"{label}: could not connect to the URL's host ({type(e).__name__})", "media_upstream_error"
                ) from None
            try:
                if response.status_code in (301, 302, 303, 307, 308) and "location" in response.headers:
                    url = urllib.parse.urljoin(url, response.headers["location"])
                    continue
                if 400 <= response.status_code < 500:
                    raise FetchError(f"{label}: the URL's server answered {response.status_code}")
                if response.status_code >= 300:
                    raise FetchError(
                        f"{label}: the URL's server failed ({response.status_code})", "media_upstream_error"
                    )
                return await _read_capped(response, policy.max_bytes, label)
            finally:
                await response.aclose()
    raise FetchError(f"{label}: more than {policy.max_redirects} redirects")


async def _read_capped(response: httpx.Response, max_bytes: int, label: str) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise FetchError(f"{label}: the file is {declared} bytes, over the {max_bytes}-byte limit", "media_too_large")
    encoding = response.headers.get("content-encoding", "identity").lower()
    if encoding not in ("identity", "gzip", "deflate", ""):
        raise FetchError(f"{label}: unsupported content encoding {encoding!r}")
    inflate = zlib.decompressobj(wbits=47) if encoding in ("gzip", "deflate") else None  # 47: gzip or zlib header
    chunks: list[bytes] = []
    total = 0
    async for raw in response.aiter_raw():
        pieces = [raw]
        if inflate is not None:
            pieces = []
            data = raw
            while data:
                # Never inflate more than the cap allows in one go: memory stays bounded.
                out = inflate.decompress(data, max_bytes - total + 1)
                pieces.append(out)
                data = inflate.unconsumed_tail
                if total + sum(map(len, pieces)) > max_bytes:
                    break
        for piece in pieces:
            total += len(piece)
            if total > max_bytes:
                raise FetchError(f"{label}: the file is over the {max_bytes}-byte limit", "media_too_large")
            chunks.append(piece)
    return b"".join(chunks)
