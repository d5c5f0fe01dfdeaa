"""The chat page `vlmserve serve` serves at `/` (off with --disable-web-ui): three static files
(and its icon) shipped in the package (vlmserve/api/web/), no build step and nothing fetched from elsewhere.
The page is a client of the server's own OpenAI-compatible API (it sends the API key a user types
in), so serving it needs no key: only these exact paths are open, each answered with a
Content-Security-Policy that allows scripts, styles and connections from this origin only."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

# The page's files by the path they are served at (below the ASGI root_path), with their type.
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/web/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/web/style.css": ("style.css", "text/css; charset=utf-8"),
    "/web/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
WEB_PATHS = tuple(FILES)
# Pictures the user picks are shown from blob: URLs and sent as data: URLs; nothing else leaves
# this origin. No inline script or style: model text reaches the page only as text nodes.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' blob: data:; media-src 'self' blob: data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_routes(app: FastAPI) -> None:
    """GET the page's files (read once, here: a missing file fails at start, not on a request)."""
    folder = resources.files("vlmserve.api") / "web"
    for path, (name, media_type) in FILES.items():
        app.add_api_route(
            path, _handler((folder / name).read_bytes(), media_type), methods=["GET"], include_in_schema=False
        )


def _handler(body: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def serve() -> Response:
        return Response(body, media_type=media_type, headers=HEADERS)

    return serve
