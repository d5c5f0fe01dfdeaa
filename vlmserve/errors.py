"""Errors a user can put right: the command line reports them in one line (no traceback), the
server in OpenAI's error shape."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any


class UserError(Exception):
    """Running the command failed for a reason outside vlmserve (a busy port, no network): exit 1."""

    exit_code = 1


class UsageError(UserError):
    """The command line itself is wrong (an option's value, a path that names nothing): exit 2."""

    exit_code = 2


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "service_unavailable",
        }.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


async def send_error(send: Callable[[Any], Awaitable[None]], error: APIError, *, close: bool = False) -> None:
    """The error as an ASGI app's whole response (for middleware that answers before the app);
    `close` ends the connection after it (a body left unread)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
