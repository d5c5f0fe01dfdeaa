"""Bounds on what client connections may hold of the API process's file descriptors.

uvicorn accepts every connection and keeps it until the client or a timeout closes it, so idle
sockets (sent nothing, or nothing more) hold descriptors until --read-timeout: a few hundred
of them under a low RLIMIT_NOFILE left none for new connections, /health or shared memory.

At start the process raises its soft RLIMIT_NOFILE to the hard limit (as vLLM does), and keeps
the number of client connections under a cap that fits in it. A connection past the cap makes
room by closing the connection that has waited longest without a request in progress (one
waiting for its first or next request's headers, then one still sending its body); a client
that sends a request at once, /health's probe included, is therefore served however many idle
sockets are open. Only when every connection under the cap has a request being answered does the
new one's request get 503 (in OpenAI's error shape), the connection closed after it.

uvicorn's own `limit_concurrency` does not fit: it keeps accepting (the descriptors are spent
anyway) and answers every request past it 503, /health too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from vlmserve.api.protocol import APIError

logger = logging.getLogger("vlmserve.api")

# Descriptors kept for the process's own use over those open at start: shared-memory segments
# being written, media fetches, log files, the engine's sockets.
RESERVED_DESCRIPTORS = 64
LOG_EVERY_S = 10.0  # at most one line per this many seconds about connections closed for room


def raise_open_files_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise, nothing known
        return 1 << 20
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        logger.warning("could not raise the open-files limit from %d to %d: %s", soft, target, e)
        return soft
    return target


def open_descriptors() -> int:
    """How many descriptors this process has open (0 where that cannot be read)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 0


def connection_limits(requested: int, soft_limit: int, in_use: int) -> tuple[int, int]:
    """(most client connections, listen backlog) that fit beside the `in_use` descriptors and the
    reserve. NOTE: asyncio accepts up to `backlog` connections in a row before the protocol of any
    of them runs (and may start on the next batch first), so past the cap up to twice the backlog
    can be open for a moment; the cap leaves room for that."""
    available = soft_limit - in_use - RESERVED_DESCRIPTORS
    backlog = min(2048, max(16, available // 4))
    return max(1, min(requested, available - 2 * backlog)), backlog


def _idle(connection: Any) -> bool:
    """Waiting for a request's headers (the first, or the next on a kept-alive connection)."""
    cycle = getattr(connection, "cycle", None)
    return cycle is None or bool(cycle.response_complete)


def _sending_body(connection: Any) -> bool:
    """Its request's headers are in, its body is not, nothing is answered yet."""
    cycle = getattr(connection, "cycle", None)
    return cycle is not None and cycle.more_body and not cycle.response_started


def capped_connections(protocol: type[H11Protocol], max_connections: int) -> type[H11Protocol]:
    """`protocol` keeping at most `max_connections` client connections open (see the module)."""
    closed_for_room = [0, -LOG_EVERY_S]  # since the last log line; when that was

    class CappedProtocol(protocol):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._idle_since = self.loop.time()
            live = [c for c in self.connections if c is not self and not c.transport.is_closing()]
            if len(live) < max_connections:
                return
            victim = min(filter(_idle, live), key=_waited, default=None)
            if victim is None:
                victim = min(filter(_sending_body, live), key=_waited, default=None)
            if victim is None:
                # Every one has a request being answered: this one's request gets a 503 (closing
                # it now would reset it, the answer unread). Until then it is idle, the first
                # to make room for the next connection.
                logger.warning("at the limit of %d connections, all serving requests: answering 503", max_connections)
                self.app = _refuse(max_connections)
                return
            victim.transport.close()
            closed_for_room[0] += 1
            now = self.loop.time()
            if now - closed_for_room[1] >= LOG_EVERY_S:
                logger.warning(
                    "at the limit of %d connections: closed %d (since the last such line) that waited longest "
                    "without a request",
                    max_connections,
                    closed_for_room[0],
                )
                closed_for_room[:] = [0, now]

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._idle_since = self.loop.time()

    return CappedProtocol


def _refuse(max_connections: int) -> Callable[..., Awaitable[None]]:
    """An ASGI app answering 503 in OpenAI's shape and closing the connection."""
    error = APIError(503, f"the server is at its limit of {max_connections} connections", code="too_many_connections")
    body = json.dumps(error.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]

    async def app(scope: Any, receive: Any, send: Callable[[Any], Awaitable[None]]) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def _waited(connection: Any) -> float:
    return float(getattr(connection, "_idle_since", 0.0))
