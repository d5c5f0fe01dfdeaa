"""The FastAPI application of the API process.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics.
Every error is answered in OpenAI's shape without tracebacks, addresses or paths. Pure-ASGI
layers in front of the app, outermost first:
  - size caps: 431 for too many or too large headers; 413 for a declared or streamed body over
    the limit, before any JSON is parsed;
  - API key: every path but /health and /metrics needs `Authorization: Bearer <key>`
    (compared in constant time), so no spelling of a path reaches an inference route without it;
  - admission: 503 while draining (SIGTERM) or while the engine is down, 429 past the queue limit.
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


class BodyTooLarge(Exception):
    pass


async def _send_error(send: Callable[[Any], Awaitable[None]], error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
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
        seen = 0

        async def counting_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    raise BodyTooLarge
            return message

        return await app(scope, counting_receive, send)

    return middleware


def api_key_auth(app: ASGIApp, api_key: str | None) -> ASGIApp:
    expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def middleware(
        scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if expected is None or scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            return await app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                given = value
        if not hmac.compare_digest(given, expected):
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
        if not state.client.healthy:
            return await _send_error(send, APIError(503, "the engine is not running", code="engine_unavailable"))
        if state.in_flight >= state.max_queue:
            return await _send_error(send, APIError(429, f"the server is at its limit of {state.max_queue} requests"))
        state.in_flight += 1
        try:
            return await app(scope, receive, send)
        finally:
            state.in_flight -= 1

    return middleware


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
                raise asyncio.CancelledError
    finally:
        if not task.done():
            task.cancel()


def build_app(
    ctx: ServingContext, *, api_key: str | None = None, max_body_bytes: int = 32 << 20, max_queue: int = 256
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

    @app.exception_handler(BodyTooLarge)
    async def too_large(_: Request, e: BodyTooLarge) -> JSONResponse:
        return JSONResponse(
            APIError(413, f"request body is over the {max_body_bytes}-byte limit").body(), status_code=413
        )

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")  # the details stay in the server's log
        return JSONResponse(APIError(500, "internal server error").body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        ok = ctx.client.healthy and not app.state.draining
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        ctx.metrics.update_engine(ctx.client.stats, ctx.client.engine.restarts)
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": ctx.model_name,
                    "object": "model",
                    "owned_by": "vlmserve",
                    "max_model_len": ctx.frontend.max_model_len,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        prompt, params = await _until_disconnected(request, prompt_builder.chat(body))
        if body.stream:
            return StreamingResponse(chat_serving.stream(body, prompt, params), media_type="text/event-stream")
        return JSONResponse(await _until_disconnected(request, chat_serving.response(prompt, params)))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompts, params = await _until_disconnected(request, prompt_builder.completion(body))
        if body.stream:
            return StreamingResponse(completion_serving.stream(prompts, params), media_type="text/event-stream")
        return JSONResponse(await _until_disconnected(request, completion_serving.response(prompts, params)))

    asgi: ASGIApp = admission(app, app.state)  # type: ignore[arg-type]
    asgi = api_key_auth(asgi, api_key)
    asgi = body_limit(asgi, max_body_bytes)
    return app, asgi
