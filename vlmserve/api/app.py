"""The FastAPI application of the API process.

Routes: GET / (the chat page, web_ui.py; off with --disable-web-ui), POST /v1/chat/completions,
POST /v1/completions, POST /v1/responses and GET|DELETE /v1/responses/{id} (serving_responses.py),
GET /v1/models (the served model, then its LoRA adapters), a pooling model's POST /v1/embeddings,
/pooling, /rerank (/v1/rerank, /v2/rerank) and /score (/v1/score) (serving_pooling.py), GET /health, GET /metrics, with
--allow-runtime-lora-updating POST /v1/load_lora_adapter and /v1/unload_lora_adapter (serving_models.py),
and vLLM's: POST /tokenize, POST /detokenize, POST /invocations (SageMaker's: a chat or a
completions body, told apart by its shape), GET|POST /ping, GET /version, GET /load. Paths are
matched below the ASGI root_path (`--root-path`, for a proxy that serves the API under a prefix).
Every error is answered in OpenAI's shape without tracebacks, addresses or paths. Pure-ASGI
layers in front of the app, outermost first:
  - size caps: 431 for too many or too large headers; 413 for a declared body over the limit;
  - API key: every path but /health and /metrics needs `Authorization: Bearer <key>`, given once
    (compared in constant time), so no spelling of a path reaches an inference route without it;
  - body: read whole before anything else, under a deadline (408 past it) and the size cap (413
    for a streamed body over it), the connection closed after either; a body nested deeper than
    json_limits.MAX_JSON_DEPTH is a 400 before anything parses it;
  - admission, once the body is in: 503 while draining (SIGTERM) or while the engine is down or not
    responding (the message says which), 429 past the queue limit. A client that sends headers and
    then nothing holds no place in the queue.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlmserve.api.browser_guard import cors, host_check, json_only
from vlmserve.api.engine_client import request_lora, request_owner
from vlmserve.api.json_limits import JSONLimitError, check_json_limits, loads_bounded
from vlmserve.api.prompts import PromptBuilder
from vlmserve.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from vlmserve.api.response_store import ResponseStore
from vlmserve.api.responses_protocol import ResponsesRequest
from vlmserve.api.serving import ServingContext, request_arrival
from vlmserve.api.serving_chat import ChatServing
from vlmserve.api.serving_completion import CompletionServing
from vlmserve.api.serving_models import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from vlmserve.api.serving_pooling import POOLING_PATHS, PoolingServing, refuse_generation
from vlmserve.api.serving_pooling import add_routes as add_pooling_routes
from vlmserve.api.serving_responses import ResponsesServing
from vlmserve.api.tool_calling import template_messages
from vlmserve.api.web_ui import WEB_PATHS
from vlmserve.api.web_ui import add_routes as add_web_routes
from vlmserve.errors import send_error
from vlmserve.version import __version__

logger = logging.getLogger("vlmserve.api")
OPEN_PATHS = ("/health", "/metrics", "/ping", "/version")
# POST paths that run engine requests: admitted (queue limit, draining, engine down) like /v1/.
ADMITTED_PATHS = ("/invocations", *POOLING_PATHS)
# POST paths that fetch and process media without the engine: the queue limit and draining only.
QUEUED_PATHS = ("/tokenize",)
Scope = MutableMapping[str, Any]
T = TypeVar("T", bound=BaseModel)
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def route_path(scope: Scope) -> str:
    """The path below the app's root_path (uvicorn puts `--root-path` in front of every path)."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


MAX_HEADERS = 100
# Bytes past the body limit read and dropped before a 413 (see read_body): no memory, only time
# within the read timeout.
DRAIN_BYTES = 64 * 1024 * 1024
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
            return await send_error(send, APIError(431, message))
        for name, value in headers:
            if name == b"content-length" and value.isdigit() and int(value) > max_bytes:
                return await send_error(send, APIError(413, f"request body is over the {max_bytes}-byte limit"))
        return await app(scope, receive, send)

    return middleware


def read_body(app: ASGIApp, max_bytes: int, timeout_s: float) -> ASGIApp:
    """Reads a request's whole body before the app sees the request, then replays it.

    A body slower than `timeout_s` in all gets 408, one over `max_bytes` (chunked, so not declared)
    413; both close the connection. A client gone meanwhile gets nothing. A body nested deeper
    than MAX_JSON_DEPTH gets 400 before anything parses it."""

    async def middleware(
        scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        chunks: list[bytes] = []
        seen = 0
        too_large = APIError(413, f"request body is over the {max_bytes}-byte limit")
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    seen += len(chunk)
                    more = message.get("more_body", False)
                    if seen > max_bytes:
                        # Over the limit: the rest is read and dropped (up to DRAIN_BYTES more, within
                        # the deadline) before the 413, since a client that is still sending when the
                        # connection closes gets a reset that can discard the 413 before it reads it
                        # (httpx, like most clients, sends the whole body before reading).
                        chunks.clear()
                        if not more or seen > max_bytes + DRAIN_BYTES:
                            return await send_error(send, too_large, close=True)
                        continue
                    chunks.append(chunk)
                    if not more:
                        break
        except TimeoutError:
            if seen > max_bytes:
                return await send_error(send, too_large, close=True)
            error = APIError(
                408,
                f"the request body did not arrive within {timeout_s:g} s",
                code="request_timeout",
                kind="invalid_request_error",
            )
            return await send_error(send, error, close=True)
        whole = b"".join(chunks)
        try:  # every route reads its body as JSON: none may nest past the bound (json_limits)
            check_json_limits(whole, max_chars=None)
        except JSONLimitError as e:
            return await send_error(send, APIError(400, f"the request body {e}"))
        body: bytes | None = whole

        async def replay() -> Any:
            nonlocal body
            if body is None:
                return await receive()  # after the body: only a disconnect can come
            message = {"type": "http.request", "body": body, "more_body": False}
            body = None
            return message

        return await app(scope, replay, send)

    return middleware


def api_key_auth(app: ASGIApp, api_key: str | None, open_paths: tuple[str, ...] = OPEN_PATHS) -> ASGIApp:
    expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def middleware(
        scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if expected is None or scope["type"] != "http" or route_path(scope) in open_paths:
            return await app(scope, receive, send)
        given = [value for name, value in scope.get("headers", []) if name == b"authorization"]
        if len(given) > 1:
            return await send_error(send, APIError(400, "more than one Authorization header"))
        if not hmac.compare_digest(given[0] if given else b"", expected):
            return await send_error(send, APIError(401, "missing or invalid API key", code="invalid_api_key"))
        return await app(scope, receive, send)

    return middleware


def admission(app: ASGIApp, state: Any) -> ASGIApp:
    async def middleware(
        scope: Scope, receive: Callable[[], Awaitable[Any]], send: Callable[[Any], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        path = route_path(scope)
        engine = path.startswith("/v1/") or path in ADMITTED_PATHS
        if path in OPEN_PATHS or not (engine or path in QUEUED_PATHS):
            return await app(scope, receive, send)
        if state.draining:
            return await send_error(send, APIError(503, "the server is shutting down", code="shutting_down"))
        reason = state.client.unavailable_reason
        if engine and reason is not None:
            return await send_error(send, APIError(503, reason, code="engine_unavailable"))
        if state.in_flight >= state.max_queue:
            return await send_error(send, APIError(429, f"the server is at its limit of {state.max_queue} requests"))
        state.in_flight += 1
        try:
            return await app(scope, receive, send)
        finally:
            state.in_flight -= 1

    return middleware


def _validated(model: type[T], raw: dict[str, Any]) -> T:
    """`raw` as `model`, a validation error answered as the routes' (400 naming the field)."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def _permission(name: str, created: int) -> dict[str, Any]:
    """vLLM's model permission entry (the same for every model: sampling and logprobs allowed)."""
    return {
        "id": f"modelperm-{uuid.uuid5(uuid.NAMESPACE_URL, name).hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


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
    web_ui: bool = True,
    allowed_hosts: frozenset[str] | None = None,
    allowed_origins: list[str] | None = None,
    allow_runtime_lora_updating: bool = False,
) -> tuple[FastAPI, ASGIApp]:
    """The FastAPI app and the ASGI app to serve (the app behind its middleware); `web_ui`: the
    chat page at / (web_ui.py), open without the API key (the page asks for it);
    `allowed_hosts` (None: any) and `allowed_origins` (CORS; none by default): browser_guard.py;
    `allow_runtime_lora_updating`: POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    (serving_models.py; without it they are 404s)."""
    app = FastAPI(title="vlmserve", version=__version__, docs_url=None, redoc_url=None)
    prompt_builder = PromptBuilder(ctx)
    chat_serving = ChatServing(ctx)
    completion_serving = CompletionServing(ctx)
    store = ResponseStore(ctx.responses_store_max_entries, ctx.responses_store_max_bytes)
    responses_serving = ResponsesServing(ctx, store, chat_serving)
    created = int(time.time())
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
        for k, engine in enumerate(ctx.client.engines):
            ctx.metrics.update_engine(engine.stats, engine.engine.restarts, k, engine.unavailable_reason is None)
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()  # SageMaker's health check: vLLM answers it as /health

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/load")
    async def load() -> dict[str, int]:
        return {"server_load": app.state.in_flight}  # vLLM's: requests being served

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vlmserve",
                    "root": ctx.model_root or name,
                    "parent": None,
                    "max_model_len": ctx.frontend.max_model_len,
                    "permission": [_permission(name, created)],
                    "vlmserve": {
                        "family": ctx.frontend.family.display_name,
                        "grounding_convention": ctx.frontend.family.grounding_convention,
                        "about": ctx.about,
                        "example_questions": list(ctx.example_questions),
                    },
                }
                for name in ctx.served_model_names or (ctx.model_name,)
            ]
            + ctx.models.cards(created),
        }

    if allow_runtime_lora_updating:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            return PlainTextResponse(await ctx.models.load(body))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            return PlainTextResponse(await ctx.models.unload(body))

    def arrived(model: str | None) -> None:
        """The request being served: when it arrived (its metrics), who it is (the engine's fair
        share) and the adapter its `model` names (None: the base model; 404 for an unknown name)."""
        request_arrival.set(time.monotonic())
        request_owner.set(uuid.uuid4().hex)
        request_lora.set(ctx.check_model(model))

    async def run_chat(body: ChatCompletionRequest, request: Request) -> Response:
        refuse_generation(ctx, "Chat Completions")
        arrived(body.model)
        parsing = chat_serving.parsing(body)
        prompt, params = await _until_disconnected(request, prompt_builder.chat(body))
        if body.stream:
            stream = await _until_disconnected(request, chat_serving.stream(body, prompt, params, parsing))
            return StreamingResponse(stream, media_type="text/event-stream")
        return JSONResponse(await _until_disconnected(request, chat_serving.response(body, prompt, params, parsing)))

    async def run_completions(body: CompletionRequest, request: Request) -> Response:
        refuse_generation(ctx, "Completions")
        arrived(body.model)
        prompts, params = await _until_disconnected(request, prompt_builder.completion(body))
        if body.stream:
            stream = await _until_disconnected(request, completion_serving.stream(body, prompts, params))
            return StreamingResponse(stream, media_type="text/event-stream")
        return JSONResponse(await _until_disconnected(request, completion_serving.response(body, prompts, params)))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await run_chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await run_completions(body, request)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        refuse_generation(ctx, "Responses")
        arrived(body.model)
        run = responses_serving.prepare(body)
        prompt, params = await _until_disconnected(request, responses_serving.prompt(prompt_builder, run))
        if body.stream:
            stream = await _until_disconnected(request, responses_serving.stream(run, prompt, params))
            return StreamingResponse(stream, media_type="text/event-stream")
        return JSONResponse(await _until_disconnected(request, responses_serving.create(run, prompt, params)))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return responses_serving.store.get(response_id, "response_id").response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        responses_serving.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's one inference route, as vLLM serves it: `messages` makes a chat request,
        `prompt` a completions one."""
        try:
            raw = loads_bounded(await request.body(), max_chars=None)  # the body cap bounds its size
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        if isinstance(raw, dict) and "messages" in raw:
            return await run_chat(_validated(ChatCompletionRequest, raw), request)
        if isinstance(raw, dict) and "prompt" in raw:
            return await run_completions(_validated(CompletionRequest, raw), request)
        raise APIError(400, "cannot tell the request type: give `messages` (chat) or `prompt` (completions)")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeChatRequest | TokenizeCompletionRequest, request: Request) -> dict[str, Any]:
        ctx.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            tools = {"tools": [t.model_dump(exclude_unset=True) for t in body.tools]} if body.tools else {}
            try:
                messages = template_messages(body.messages)
            except ValueError as e:
                raise APIError(400, str(e), "messages") from None
            rendering = prompt_builder.chat_prompt(
                messages,
                body.add_generation_prompt,
                tools | (body.chat_template_kwargs or {}),
                continue_final_message=body.continue_final_message,
                media=prompt_builder.media_options(body.mm_processor_kwargs, body.media_io_kwargs),
                chat_template=prompt_builder.chat_template(body.chat_template),
            )
            prompt = await _until_disconnected(request, rendering)
            tokens = list(prompt.prompt_token_ids)
        else:
            tokens = await prompt_builder.encode(body.prompt)
        answer: dict[str, Any] = {"count": len(tokens), "max_model_len": ctx.frontend.max_model_len, "tokens": tokens}
        if body.return_token_strs:
            backend = ctx.frontend.tokenizer.backend
            answer["token_strs"] = [backend.id_to_token(t) for t in tokens]
        return answer

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        vocab = ctx.frontend.tokenizer.backend.get_vocab_size(with_added_tokens=True)
        for i, token in enumerate(body.tokens):
            if token >= vocab:
                raise APIError(400, f"tokens[{i}] = {token} is not a token id (the vocabulary has {vocab})", "tokens")
        text = await asyncio.to_thread(ctx.frontend.tokenizer.decode, body.tokens, False)
        return {"prompt": text}

    add_pooling_routes(app, PoolingServing(ctx, prompt_builder), arrived, _until_disconnected)
    if web_ui:
        add_web_routes(app)
    asgi: ASGIApp = admission(app, app.state)  # type: ignore[arg-type]
    asgi = read_body(asgi, max_body_bytes, read_timeout_s)
    asgi = api_key_auth(asgi, api_key, OPEN_PATHS + WEB_PATHS if web_ui else OPEN_PATHS)
    asgi = body_limit(asgi, max_body_bytes)
    asgi = json_only(asgi)
    asgi = cors(asgi, allowed_origins or [])
    asgi = host_check(asgi, allowed_hosts)
    return app, asgi
