"""The pooling models' endpoints (a server started with --runner pooling, or "auto" on an
embedding or reranker checkpoint): /v1/embeddings, /pooling, /rerank (/v1/rerank, /v2/rerank) and
/score (/v1/score), in vLLM's shapes. The generation endpoints refuse such a model, and these
endpoints a generation model, with vLLM's messages.

Inputs are made into prompts as the offline LLM.embed / LLM.score make them
(vlmserve/entrypoints/llm_pooling.py): a string or token ids embedded as it is (vLLM's), messages
rendered with the chat template, a reranker's (query, document) pairs built into its yes/no
conversation (vlmserve/api/retrieval.py), and an embedding model's score the cosine similarity of
the two embeddings. All of one request's prompts go to the engine before any is awaited, so they
run in the same steps; each is one engine request of the pooling kind, whose only output is its
vector (EngineClient.pool)."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from vlmserve.api.engine_client import RequestFailedInEngine, RequestRefused
from vlmserve.api.engine_supervisor import EngineDeadError
from vlmserve.api.json_limits import loads_bounded
from vlmserve.api.pooling_protocol import (
    EmbeddingChatRequest,
    EmbeddingCompletionRequest,
    RerankRequest,
    ScoreItem,
    ScoreRequest,
)
from vlmserve.api.prompts import PromptBuilder, Truncation
from vlmserve.api.protocol import check_text
from vlmserve.api.retrieval import embedding_conversation, is_content_parts, reranker_conversation
from vlmserve.api.serving import ServingContext, engine_error
from vlmserve.api.tool_calling import template_messages
from vlmserve.errors import APIError
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import PoolingRequestOutput
from vlmserve.pooling import PoolerConfig, PoolingParams
from vlmserve.processor.media_options import MediaDefaults
from vlmserve.processor.truncation import truncation_size

logger = logging.getLogger("vlmserve.api")

# The paths of these endpoints outside /v1/ (the admission middleware admits them as it does /v1/).
POOLING_PATHS = ("/pooling", "/rerank", "/v2/rerank", "/score")


def refuse_generation(ctx: ServingContext, api: str) -> None:
    """A generation endpoint on a pooling model: vLLM's message (a 400), and what serves it."""
    pooler = ctx.frontend.pooler
    if pooler is not None:
        raise APIError(
            400,
            f"The model does not support {api} API: it is a pooling model (task {pooler.task!r}), served at "
            "/v1/embeddings, /pooling, /rerank and /score; start the server with --runner generate for text",
        )


def _pooler(ctx: ServingContext, api: str, task: str | None = None) -> PoolerConfig:
    """The pooling model's pooler; vLLM's message (a 400) on a generation model, or on a model of
    another task than `task`."""
    pooler = ctx.frontend.pooler
    if pooler is None:
        raise APIError(
            400,
            f"The model does not support {api} API: it generates text; start the server with an embedding or "
            "reranker model (--runner pooling) for embeddings and scores",
        )
    if task is not None and pooler.task != task:
        raise APIError(
            400,
            f"The model does not support {api} API: it is a pooling model of task {pooler.task!r} "
            "(a reranker's scores are served at /rerank and /score)",
        )
    return pooler


def _documents(documents: list[ScoreItem] | dict[str, Any], param: str) -> list[ScoreItem]:
    """The documents of a request: a list of them, or vLLM's {"content": [parts]} (each part one)."""
    if isinstance(documents, dict):
        content = documents.get("content")
        if set(documents) != {"content"} or not isinstance(content, list):
            raise APIError(400, f'{param} must be a list of documents, or {{"content": [parts]}}', param)
        return [{"content": [part]} for part in content]
    return list(documents)


def _as_list(value: object, param: str) -> list[ScoreItem]:
    if isinstance(value, dict) and set(value) == {"content"}:
        return _documents(value, param)
    if isinstance(value, (str, dict)) or is_content_parts(value):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[call-overload]


def _document_echo(document: ScoreItem) -> dict[str, Any]:
    """A result's document as vLLM writes it: {"text": ...} or {"multi_modal": part}."""
    if isinstance(document, str):
        return {"text": document}
    if isinstance(document, dict) and set(document) == {"content"} and len(document["content"]) == 1:
        return {"multi_modal": document["content"][0]}
    return {"multi_modal": document}


class PoolingServing:
    def __init__(self, ctx: ServingContext, prompts: PromptBuilder) -> None:
        self.ctx = ctx
        self.prompts = prompts

    # -- endpoints --------------------------------------------------------------------------------

    async def embeddings(
        self, body: EmbeddingCompletionRequest | EmbeddingChatRequest, *, raw: bool = False
    ) -> dict[str, Any]:
        """/v1/embeddings (raw: /pooling, the vectors as the model pools them, whatever its task)."""
        api = "Pooling" if raw else "Embeddings"
        pooler = _pooler(self.ctx, api, None if raw else "embed")
        params = PoolingParams(body.dimensions, body.normalize, pooler.task)
        try:
            params.verify(pooler)
        except ValueError as e:
            raise APIError(400, str(e), "dimensions") from None
        truncation = self._truncation(body.truncate_prompt_tokens)
        if isinstance(body, EmbeddingChatRequest):
            self._check_count(1, "messages")
            prompts = [await self._chat(body, truncation)]
        else:
            inputs = self._inputs(body.input)
            self._check_count(len(inputs), "input")
            prompts = [
                await self._raw(item, self._where(i, len(inputs), "input"), truncation) for i, item in enumerate(inputs)
            ]
        outputs = await self._pool(prompts, params, "embd")
        tokens = sum(len(p.prompt_token_ids) for p in prompts)
        kind = "pooling" if raw else "embedding"
        data = [
            {
                "index": i,
                "object": kind,
                ("data" if raw else "embedding"): _encoded(o.outputs.data, body.encoding_format),
            }
            for i, o in enumerate(outputs)
        ]
        return {
            "id": f"{'pool' if raw else 'embd'}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": self.ctx.response_model(),
            "data": data,
            "usage": {
                "prompt_tokens": tokens,
                "total_tokens": tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }

    async def rerank(self, body: RerankRequest) -> dict[str, Any]:
        _pooler(self.ctx, "Rerank (Score)")
        documents = _documents(body.documents, "documents")
        if not documents:
            raise APIError(400, "documents is empty: give at least one document to rank", "documents")
        scores, tokens = await self._scores(
            [("query", body.query)] * len(documents), self._labelled(documents, "documents"), body
        )
        ranked = sorted(range(len(documents)), key=lambda i: -scores[i])
        if body.top_n:
            ranked = ranked[: body.top_n]
        results = []
        for i in ranked:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = _document_echo(documents[i])
            results.append(result)
        return {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": self.ctx.response_model(),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": results,
        }

    async def score(self, body: ScoreRequest) -> dict[str, Any]:
        _pooler(self.ctx, "Score")
        firsts, seconds = _as_list(body.text_1, "text_1"), _as_list(body.text_2, "text_2")
        if not firsts or not seconds:
            empty = "text_1" if not firsts else "text_2"
            raise APIError(400, f"{empty} is empty: give at least one text to score", empty)
        left = self._labelled(firsts, "text_1")
        if len(firsts) == 1:
            left = left * len(seconds)
        elif len(firsts) != len(seconds):
            raise APIError(
                400,
                f"text_1 has {len(firsts)} items and text_2 {len(seconds)}: give one text_1 (scored against each of "
                "text_2), or as many as text_2 (scored pairwise)",
                "text_1",
            )
        scores, tokens = await self._scores(left, self._labelled(seconds, "text_2"), body)
        return {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": self.ctx.response_model(),
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {
                "prompt_tokens": tokens,
                "total_tokens": tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }

    # -- prompts ----------------------------------------------------------------------------------

    @staticmethod
    def _where(i: int, n: int, param: str) -> str:
        return param if n == 1 else f"{param}[{i}]"

    @staticmethod
    def _labelled(items: list[ScoreItem], param: str) -> list[tuple[str, ScoreItem]]:
        return [(f"{param}[{i}]", item) for i, item in enumerate(items)]

    @staticmethod
    def _inputs(value: object) -> list[str | list[int]]:
        if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
            return [value]  # type: ignore[list-item]
        assert isinstance(value, list)
        if not value:
            raise APIError(400, "input is an empty list: give a string, token ids, or a list of them", "input")
        return value

    def _check_count(self, count: int, param: str) -> None:
        """One request's prompts all run at once: no more than the engine runs together (an
        embedding model's scores: the query and each document, a reranker's: one per document)."""
        limit = self.ctx.client.engines[0].config.max_num_seqs
        if count > limit:
            raise APIError(
                400,
                f"this request has {count} prompts to run at once, more than the {limit} sequences the engine runs "
                f"together (--max-num-seqs): split the request into requests of at most {limit} prompts",
                param,
            )

    def _truncation(self, truncate_prompt_tokens: int | None) -> Truncation | None:
        try:
            keep = truncation_size(truncate_prompt_tokens, self.ctx.frontend.max_model_len)
        except ValueError as e:
            raise APIError(400, str(e), "truncate_prompt_tokens") from None
        return None if keep is None else (keep, "left")

    async def _raw(self, item: str | list[int], param: str, truncation: Truncation | None) -> ProcessedPrompt:
        """A string or token ids, embedded as they are (no template: vLLM's)."""
        if isinstance(item, str):
            check_text(item, param)
            self.prompts._check_length(item, param)
        if len(item) == 0:
            raise APIError(400, f"{param} is empty: there is nothing to embed", param)
        return await self.prompts._process(item, [], param, None, truncation)

    async def _chat(self, body: EmbeddingChatRequest, truncation: Truncation | None) -> ProcessedPrompt:
        try:
            messages = template_messages(body.messages)
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        return await self.prompts.chat_prompt(
            messages,
            body.add_generation_prompt,
            body.chat_template_kwargs,
            continue_final_message=body.continue_final_message,
            media=self.prompts.media_options(body.mm_processor_kwargs, body.media_io_kwargs),
            truncation=truncation,
            chat_template=self.prompts.chat_template(body.chat_template),
        )

    async def _conversation(
        self,
        build: Callable[[], list[dict[str, Any]]],
        where: str,
        param: str,
        media: MediaDefaults,
        truncation: Truncation | None,
    ) -> ProcessedPrompt:
        """The conversation `build` makes, rendered and processed; an error in it is a 400 that
        names the inputs it was made of (`where`; the field `param`), not its messages."""
        try:
            messages = build()
        except ValueError as e:
            raise APIError(400, str(e), param) from None
        try:
            return await self.prompts.chat_prompt(messages, True, None, media=media, truncation=truncation)
        except APIError as e:
            if e.param == "messages":
                e.param = param
                e.message = f"{where}: {e.message}"
            raise

    async def _embedding_input(
        self, where: str, item: ScoreItem, instruction: str | None, media: MediaDefaults, truncation: Truncation | None
    ) -> ProcessedPrompt:
        """One side of an embedding model's score: a string as it is, anything else the
        embedding model's official conversation (as LLM.score)."""
        if isinstance(item, str):
            return await self._raw(item, where, truncation)
        return await self._conversation(
            lambda: embedding_conversation(item, instruction, where), where, where, media, truncation
        )

    async def _scores(
        self,
        left: list[tuple[str, ScoreItem]],
        right: list[tuple[str, ScoreItem]],
        body: RerankRequest | ScoreRequest,
    ) -> tuple[list[float], int]:
        """Each pair's score, and the prompt tokens it took: a reranker's yes/no probability, or
        the cosine similarity of an embedding model's two embeddings (each side embedded once)."""
        pooler = self.ctx.frontend.pooler
        assert pooler is not None
        media = self.prompts.media_options(body.mm_processor_kwargs, body.media_io_kwargs)
        truncation = self._truncation(body.truncate_prompt_tokens)
        if pooler.task == "score":
            self._check_count(len(right), "documents" if isinstance(body, RerankRequest) else "text_2")
            prompts = [
                await self._conversation(
                    partial(reranker_conversation, a, b, body.instruction, (where_a, where_b)),
                    f"{where_a}, {where_b}",
                    where_b,
                    media,
                    truncation,
                )
                for (where_a, a), (where_b, b) in zip(left, right, strict=True)
            ]
            outputs = await self._pool(prompts, PoolingParams(task="score"), "score")
            return [float(o.outputs.data[0]) for o in outputs], sum(len(p.prompt_token_ids) for p in prompts)
        # An embedding model: each distinct side once (one query against many documents).
        sides = list(dict.fromkeys(where for where, _ in left)) + [where for where, _ in right]
        items = dict(left) | dict(right)
        self._check_count(len(sides), "documents" if isinstance(body, RerankRequest) else "text_2")
        prompts = [
            await self._embedding_input(where, items[where], body.instruction, media, truncation) for where in sides
        ]
        vectors = dict(zip(sides, await self._pool(prompts, PoolingParams(task="embed"), "score"), strict=True))
        scores = [
            float(torch.nn.functional.cosine_similarity(vectors[a].outputs.data, vectors[b].outputs.data, dim=0))
            for (a, _), (b, _) in zip(left, right, strict=True)
        ]
        return scores, sum(len(p.prompt_token_ids) for p in prompts)

    # -- the engine -------------------------------------------------------------------------------

    async def _pool(
        self, prompts: Sequence[ProcessedPrompt], params: PoolingParams, kind: str
    ) -> list[PoolingRequestOutput]:
        """Every prompt's vector: all sent before any is awaited (they run batched); if one fails,
        the others are aborted and the request answered with its error."""
        metrics = self.ctx.metrics
        metrics.in_flight.inc()
        outcome = "aborted"
        base = f"{kind}-{uuid.uuid4().hex}"
        tasks = [
            asyncio.ensure_future(self.ctx.client.pool(f"{base}-{i}", prompt, params))
            for i, prompt in enumerate(prompts)
        ]
        try:
            outputs = await asyncio.gather(*tasks)
            outcome = "success"
            metrics.prompt_tokens.inc(sum(len(p.prompt_token_ids) for p in prompts))
            metrics.image_tokens.inc(sum(item.length for p in prompts for item in p.mm_items))
            return list(outputs)
        except (RequestRefused, RequestFailedInEngine, EngineDeadError) as e:
            outcome, error = engine_error(e, base)
            raise error from None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            metrics.in_flight.dec()
            metrics.requests.labels(outcome).inc()


def _encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """float: a list; base64: the little-endian float32 bytes, as OpenAI's API and vLLM send them."""
    if encoding_format == "base64":
        data = vector.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        return base64.b64encode(data).decode()
    return vector.tolist()  # type: ignore[no-any-return]


def add_routes(
    app: FastAPI,
    serving: PoolingServing,
    arrived: Callable[[str | None], None],
    until_disconnected: Callable[[Request, Awaitable[Any]], Awaitable[Any]],
) -> None:
    """The routes. `arrived`: the request's bookkeeping (its model named); `until_disconnected`:
    the work cancelled when the client goes."""

    async def run(request: Request, body: Any, work: Callable[[Any], Awaitable[dict[str, Any]]]) -> Response:
        arrived(body.model)
        return JSONResponse(await until_disconnected(request, work(body)))

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await run(request, await _embedding_body(request), serving.embeddings)

    @app.post("/pooling")
    async def pooling(request: Request) -> Response:
        return await run(request, await _embedding_body(request), lambda b: serving.embeddings(b, raw=True))

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(_rerank_route(run, serving))
    for path in ("/score", "/v1/score"):
        app.post(path)(_score_route(run, serving))


async def _embedding_body(request: Request) -> EmbeddingCompletionRequest | EmbeddingChatRequest:
    """vLLM's two embedding bodies, told apart by `messages` (a validation error answered as the
    routes' own: a 400 naming the field)."""
    try:
        raw = loads_bounded(await request.body(), max_chars=None)  # the body cap bounds its size
    except ValueError:
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(raw, dict):
        raise APIError(400, "the request body must be a JSON object with `input` or `messages`")
    model = EmbeddingChatRequest if "messages" in raw else EmbeddingCompletionRequest
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def _rerank_route(
    run: Callable[..., Awaitable[Response]], serving: PoolingServing
) -> Callable[..., Awaitable[Response]]:
    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await run(request, body, serving.rerank)

    return rerank


def _score_route(
    run: Callable[..., Awaitable[Response]], serving: PoolingServing
) -> Callable[..., Awaitable[Response]]:
    async def score(body: ScoreRequest, request: Request) -> Response:
        return await run(request, body, serving.score)

    return score
