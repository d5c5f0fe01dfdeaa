"""The FastAPI application of the API process.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics.
Every error is answered in OpenAI's shape without tracebacks, addresses or paths. Pure-ASGI
layers in front of the app, outermost first:
  - size caps: 431 for too many or too large headers; 413 for a declared body over the limit;
  - API key: every path but /health and /metrics needs `Authorization: Bearer <key>`, given once
    (compared in constant time), so no spelling of a path reaches an inference route without it;
  - body: read whole before anything else, under a deadline (408 past it) and the size cap (413
    for a streamed body over it), the connection closed after either;
  - admission, once the body is in: 503 while draining (SIGTERM) or while the engine is down or not
    responding (the message says which), 429 past the queue limit. A client that sends headers and
    then nothing holds no place in the queue.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlmserve.serve.prompts import PromptBuilder
from vlmserve.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from vlmserve.serve.serving import ServingContext
from vlmserve.serve.serving_chat import ChatServing
from vlmserve.serve.serving_completion import CompletionServing

logger = logging.getLogger("vlmserve.api")
OPEN_PATHS = ("/health", "/metrics")
Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


async def _send_error(send: Callable[[Any], Awaitable[None]], error: APIError, *, close: bool = False) -> None:
    """The error as the whole response; `close` ends the connection after it (a body left unread)."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


MAX_HEADERS = 100
MAX_HEADER_BYTES = 16 * 1024


def body_limit(app: ASGIApp, max_bytes: int) -> ASGIApp:
    async def middleware(
        scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        headers = scope.get("headers", [])
        if len(headers) > MAX_HEADERS or sum(len(n) + len(v) for n, v in headers) > MAX_HEADER_BYTES:
            message = f"request headers are over the limit ({MAX_HEADERS} headers, {MAX_HEADER_BYTES} bytes)"
            return await _send_error(send, APIError(431, message))
        for name, value in headers:
            if name == b"content-length" and value.isdigit() and int(value) > max_bytes:
                return await _send_error(send, APIError(413, f"request body is over the {max_bytes}-byte limit"))
        return await app(scope, receive, send)

    return middleware


def read_body(app: ASGIApp, max_bytes: int, timeout_s: float) -> ASGIApp:
    """Reads a request's whole body before the app sees the request, then replays it.

    A body slower than `timeout_s` in all gets 408, one over `max_bytes` (chunked, so not declared)
    413; both close the connection. A client gone meanwhile gets nothing."""

    async def middleware(
        scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        chunks: list[bytes] = []
        seen = 0
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    seen += len(chunk)
                    if seen > max_bytes:
                        error = APIError(413, f"request body is over the {max_bytes}-byte limit")
                        return await _send_error(send, error, close=True)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            error = APIError(
                408,
                f"the request body did not arrive within {timeout_s:g} s",
                code="request_timeout",
                kind="invalid_request_error",
            )
            return await _send_error(send, error, close=True)
        body: bytes | None = b"".join(chunks)

        async def replay() -> Any:
            nonlocal body
            if body is None:
                return await receive()  # after the body: only a disconnect can come
            message = {"type": "http.request", "body": body, "more_body": False}
            body = None
            return message

        return await app(scope, replay, send)

    return middleware


def api_key_auth(app: ASGIApp, api_key: str | None) -> ASGIApp:
    expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def middleware(
        scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if expected is None or scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            return await app(scope, receive, send)
        given = [value for name, value in scope.get("headers", []) if name == b"authorization"]
        if len(given) > 1:
            return await _send_error(send, APIError(400, "more than one Authorization header"))
        if not hmac.compare_digest(given[0] if given else b"", expected):
            return await _send_error(send, APIError(401, "missing or invalid API key", code="invalid_api_key"))
        return await app(scope, receive, send)

    return middleware


def admission(app: ASGIApp, state: Any) -> ASGIApp:
    async def middleware(
        scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or not path.startswith("/v1/") or scope["method"] != "POST":
            return await app(scope, receive, send)
        if state.draining:
            return await _send_error(send, APIError(503, "the server is shutting down", code="shutting_down"))
        reason = state.client.unavailable_reason
        if reason is not None:
            return await _send_error(send, APIError(503, reason, code="engine_unavailable"))
        if state.in_flight >= state.max_queue:
            return await _send_error(send, APIError(429, f"the server is at its limit of {state.max_queue} requests"))
        state.in_flight += 1
        try:
            return await app(scope, receive, send)
        finally:
            state.in_flight -= 1

    return middleware


class ClientDisconnected(Exception):
    """The client went away before its answer: an expected event, logged in one line."""


async def _until_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it (and so aborting its engine request) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise ClientDisconnected
    finally:
        if not task.done():
            task.cancel()


def build_app(
    ctx: ServingContext,
    *,
    api_key: str | None = None,
    max_body_bytes: int = 32 << 20,
    max_queue: int = 256,
    read_timeout_s: float = 30.0,
) -> tuple[FastAPI, ASGIApp]:
    """The FastAPI app and the ASGI app to serve (the app behind its middleware)."""
    app = FastAPI(title="vlmserve", docs_url=None, redoc_url=None)
    prompt_builder = PromptBuilder(ctx)
    chat_serving = ChatServing(ctx)
    completion_serving = CompletionServing(ctx)
    app.state.client = ctx.client
    app.state.draining = False
    app.state.in_flight = 0
    app.state.max_queue = max_queue

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        param = ".".join(loc) or None
        kind = first.get("type", "")
        message = (
            "the request body is not valid JSON"
            if kind == "json_invalid"
            else (
                f"{param}: {first.get('msg', 'invalid value')}"
                if param
                else str(first.get("msg", "invalid request body"))
            )
        )
        return JSONResponse(APIError(400, message, param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, _: ClientDisconnected) -> Response:
        logger.info("client disconnected before its answer: %s %s aborted", request.method, request.url.path)
        return Response(status_code=499)  # nginx's "client closed request"; nobody is left to read it

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")  # the details stay in the server's log
        return JSONResponse(APIError(500, "internal server error").body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        reason = "the server is shutting down" if app.state.draining else ctx.client.unavailable_reason
        if reason is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        ctx.metrics.update_engine(ctx.client.stats, ctx.client.engine.restarts)
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "owned_by": "vlmserve", "max_model_len": ctx.frontend.max_model_len}
                for name in ctx.served_model_names or (ctx.model_name,)
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        ctx.check_model(body.model)
        prompt, params = await _until_disconnected(request, prompt_builder.chat(body))
        if body.stream:
            return StreamingResponse(chat_serving.stream(body, prompt, params), media_type="text/event-stream")
        return JSONResponse(await _until_disconnected(request, chat_serving.response(prompt, params)))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ctx.check_model(body.model)
        prompts, params = await _until_disconnected(request, prompt_builder.completion(body))
        if body.stream:
            return StreamingResponse(
                completion_serving.stream(
                    prompts, params, include_usage=bool(body.stream_options and body.stream_options.include_usage)
                ),
                media_type="text/event-stream",
            )
        return JSONResponse(await _until_disconnected(request, completion_serving.response(prompts, params)))

    asgi: ASGIApp = admission(app, app.state)  # type: ignore[arg-type]
    asgi = read_body(asgi, max_body_bytes, read_timeout_s)
    asgi = api_key_auth(asgi, api_key)
    asgi = body_limit(asgi, max_body_bytes)
    return app, asgi
