"""Chat and text completions: a request becomes a processed prompt (media fetched through the
guard, chat template, processor), goes to the engine, and comes back as OpenAI's JSON or as
server-sent events."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from vlmserve.engine.frontend import Frontend
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.multimodal.media import MediaError
from vlmserve.outputs import CompletionOutput, RequestOutput
from vlmserve.processor.base import ImageInput, VideoInput
from vlmserve.sampling_params import SamplingParams
from vlmserve.serve.engine_client import EngineClient, EngineDeadError, RequestRefused
from vlmserve.serve.fetch import FetchError, FetchPolicy, fetch
from vlmserve.serve.metrics import Metrics
from vlmserve.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, check_text


@dataclass
class ServingContext:
    frontend: Frontend
    client: EngineClient
    metrics: Metrics
    fetch_policy: FetchPolicy
    model_name: str
    max_n: int = 8


def _walk_text(value: Any, param: str) -> None:
    if isinstance(value, str):
        check_text(value, param)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _walk_text(v, f"{param}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _walk_text(v, f"{param}.{k}")


class Serving:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.frontend = ctx.frontend
        self.grounding_convention: str | None = ctx.frontend.family.grounding_convention

    # -- shared steps -----------------------------------------------------------------------------

    def _max_tokens(self, requested: int | None) -> int | None:
        limit = self.frontend.max_model_len - 1
        if requested is not None and requested > limit:
            raise APIError(400, f"max_tokens must be at most {limit} (max_model_len - 1)", "max_tokens")
        return requested

    async def _fetch_media(
        self, images: list[ImageInput], videos: list[VideoInput]
    ) -> tuple[list[ImageInput], list[VideoInput]]:
        """http(s) sources downloaded through the guarded fetcher (a video's frames one by one);
        counts checked first so that no request makes the server fetch more than it may use."""
        limits = self.frontend.processor.max_items_per_prompt()
        for kind, given in (("image", images), ("video", videos)):
            if len(given) > limits.get(kind, 0):
                raise APIError(
                    400, f"too many {kind}s: {len(given)} given, at most {limits.get(kind, 0)} per request", "messages"
                )
        video_policy = dataclasses.replace(
            self.ctx.fetch_policy, max_bytes=self.frontend.processor.media_limits.max_video_bytes
        )
        fetched_images = [
            ImageInput(await self._fetched(image.source, self.ctx.fetch_policy, image.label), image.sizing, image.label)
            for image in images
        ]
        fetched_videos = []
        for video in videos:
            source = video.source
            if isinstance(source, list):
                frames = [
                    await self._fetched(frame, self.ctx.fetch_policy, f"{video.label} frame {k}")
                    for k, frame in enumerate(source)
                ]
                fetched_videos.append(VideoInput(frames, video.options, video.label))
            else:
                fetched_videos.append(
                    VideoInput(await self._fetched(source, video_policy, video.label), video.options, video.label)
                )
        return fetched_images, fetched_videos

    async def _fetched(self, source: object, policy: FetchPolicy, label: str) -> object:
        """The bytes behind an http(s) URL; any other source as it is (the processor reads it)."""
        if not (isinstance(source, str) and source[:8].lower().startswith(("http://", "https://"))):
            return source
        try:
            return await fetch(source, policy, label)
        except FetchError as e:
            raise APIError(400, str(e), "messages", e.code) from None

    async def _process(
        self, prompt: str | list[int], images: list[ImageInput], param: str, videos: list[VideoInput] | None = None
    ) -> ProcessedPrompt:
        try:
            # Decoding and resizing images and video frames is CPU work: off the event loop.
            return await asyncio.to_thread(self.frontend.processor.process, prompt, images, videos or [])
        except (MediaError, ValueError) as e:
            raise APIError(400, str(e), param) from None

    async def _outputs(
        self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        metrics = self.ctx.metrics
        metrics.in_flight.inc()
        outcome = "aborted"
        try:
            async with aclosing(self.ctx.client.generate(request_id, prompt, params)) as outputs:
                async for output in outputs:
                    if output.finished:
                        outcome = "success"
                        metrics.prompt_tokens.inc(len(output.prompt_token_ids))
                        metrics.image_tokens.inc(sum(output.num_image_tokens))
                        metrics.generation_tokens.inc(sum(len(o.token_ids) for o in output.outputs))
                    yield output
        except RequestRefused as e:
            outcome = "error"
            raise APIError(400, str(e)) from None
        except EngineDeadError as e:
            outcome = "engine_down"
            raise APIError(503, str(e), code="engine_unavailable") from None
        finally:
            metrics.in_flight.dec()
            metrics.requests.labels(outcome).inc()

    def _usage(self, prompt: ProcessedPrompt, output: RequestOutput) -> dict[str, Any]:
        completion = sum(len(o.token_ids) for o in output.outputs)
        return {
            "prompt_tokens": len(output.prompt_token_ids),
            "completion_tokens": completion,
            "total_tokens": len(output.prompt_token_ids) + completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
            # Extension: each image's placeholder tokens and the size the model saw it at.
            "multimodal_tokens": [
                {
                    "modality": item.modality,
                    "tokens": item.length,
                    "original_size": list(item.original_size),
                    "resized_size": list(item.resized_size),
                }
                for item in prompt.mm_items
            ],
        }

    def _extension(self, prompts: list[ProcessedPrompt], with_prompt_index: bool = False) -> dict[str, Any]:
        """The `vlmserve` extension field of a response (or of a stream's first chunk): each image's
        size as sent and as the model saw it, and the convention of the model's grounding boxes,
        so a client can map boxes to its own pixels (vlmserve.grounding does it in Python)."""
        items = []
        for i, prompt in enumerate(prompts):
            for item in prompt.mm_items:
                entry = {
                    "modality": item.modality,
                    "original_size": list(item.original_size),
                    "resized_size": list(item.resized_size),
                }
                items.append({"prompt_index": i} | entry if with_prompt_index else entry)
        return {"grounding_convention": self.grounding_convention, "mm_items": items}

    def _logprobs_json(self, choice: CompletionOutput, start: int, k: int) -> dict[str, Any] | None:
        """OpenAI's chat logprobs for tokens [start:]: each token with its `k` most likely
        alternatives (the entries ranked 1..k; the sampled token is among them when it ranks)."""
        if choice.logprobs is None:
            return None
        tokenizer = self.frontend.tokenizer
        content = []
        for token_id, entry in zip(choice.token_ids[start:], choice.logprobs[start:], strict=True):
            chosen = entry[token_id]
            ranked = sorted(((lp.rank or 0, tid, lp) for tid, lp in entry.items() if (lp.rank or 0) <= k))
            content.append(
                {
                    "token": chosen.decoded_token,
                    "logprob": chosen.logprob,
                    "bytes": list(tokenizer.token_bytes(token_id)),
                    "top_logprobs": [
                        {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(tokenizer.token_bytes(tid))}
                        for _, tid, lp in ranked
                    ],
                }
            )
        return {"content": content}

    # -- chat ----------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest) -> tuple[ProcessedPrompt, SamplingParams]:
        _walk_text(body.messages, "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = self._max_tokens(body.max_completion_tokens or body.max_tokens)
        params = body.sampling_params(self.frontend.default_sampling_params(), max_tokens, logprobs, self.ctx.max_n)
        try:
            chat = self.frontend.render_chat(
                body.messages, body.add_generation_prompt, chat_template_kwargs=body.chat_template_kwargs
            )
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        images, videos = await self._fetch_media(chat.images, chat.videos)
        return await self._process(chat.prompt, images, "messages", videos), params

    async def chat_response(self, body: ChatCompletionRequest, prompt: ProcessedPrompt, params: SamplingParams) -> dict:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        final = await self._last(request_id, prompt, params)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.ctx.model_name,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs_json(c, 0, params.logprobs or 0),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for c in final.outputs
            ],
            "usage": self._usage(prompt, final),
            "vlmserve": self._extension([prompt]),
        }

    async def chat_stream(
        self, body: ChatCompletionRequest, prompt: ProcessedPrompt, params: SamplingParams
    ) -> AsyncIterator[str]:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.ctx.model_name}
        sent_text = [0] * params.n
        sent_tokens = [0] * params.n
        for i in range(params.n):
            role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield _sse(base | {"choices": [role]} | ({"vlmserve": self._extension([prompt])} if i == 0 else {}))
        final = None
        try:
            async for output in self._outputs(request_id, prompt, params):
                final = output
                choices = []
                for c in output.outputs:
                    delta = c.text[sent_text[c.index] :]
                    if not delta and c.finish_reason is None:
                        continue
                    logprobs = self._logprobs_json(c, sent_tokens[c.index], params.logprobs or 0)
                    sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    choices.append(
                        {
                            "index": c.index,
                            "delta": {"content": delta} if delta else {},
                            "logprobs": logprobs,
                            "finish_reason": c.finish_reason,
                        }
                    )
                if choices:
                    yield _sse(base | {"choices": choices})
        except APIError as e:
            yield _sse(e.body())
            yield "data: [DONE]\n\n"
            return
        if final is not None and body.stream_options and body.stream_options.include_usage:
            yield _sse(base | {"choices": [], "usage": self._usage(prompt, final)})
        yield "data: [DONE]\n\n"

    # -- text completions -------------------------------------------------------------------------

    async def completion(self, body: CompletionRequest) -> tuple[list[ProcessedPrompt], SamplingParams]:
        params = body.sampling_params(
            self.frontend.default_sampling_params(), self._max_tokens(body.max_tokens), body.logprobs, self.ctx.max_n
        )
        raw = body.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            batch: list[str | list[int]] = [raw]  # type: ignore[list-item]
        else:
            batch = list(raw)  # type: ignore[arg-type]
        if len(batch) > self.ctx.max_n:
            raise APIError(400, f"at most {self.ctx.max_n} prompts per request", "prompt")
        prompts = []
        for i, p in enumerate(batch):
            param = "prompt" if len(batch) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                check_text(p, param)
            images: list[ImageInput] = []
            # A family whose prompts name their images (inside the token ids): fetched here
            # through the guard, never by the processor.
            try:
                urls = self.frontend.processor.prompt_image_urls(p)
            except ValueError as e:
                raise APIError(400, str(e), param) from None
            if urls:
                images = [ImageInput(url, label=f"{param} (image {k + 1})") for k, url in enumerate(urls)]
                images, _ = await self._fetch_media(images, [])
            prompts.append(await self._process(p, images, param))  # the processor checks token ids
        return prompts, params

    async def completion_response(self, prompts: list[ProcessedPrompt], params: SamplingParams) -> dict:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        finals = await asyncio.gather(*(self._last(f"{request_id}-{i}", p, params) for i, p in enumerate(prompts)))
        choices = []
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            for c in final.outputs:
                choices.append(
                    {
                        "index": i * params.n + c.index,
                        "text": c.text,
                        "logprobs": self._legacy_logprobs(c),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
            part = self._usage(prompt, final)
            for key in usage:
                usage[key] += part[key]
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.ctx.model_name,
            "choices": choices,
            "usage": usage,
            "vlmserve": self._extension(prompts, with_prompt_index=True),
        }

    async def _last(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams) -> RequestOutput:
        final = None
        async for output in self._outputs(request_id, prompt, params):
            final = output
        assert final is not None
        return final

    async def completion_stream(self, prompts: list[ProcessedPrompt], params: SamplingParams) -> AsyncIterator[str]:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        base = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.ctx.model_name,
        }
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(i: int, prompt: ProcessedPrompt) -> None:
            try:
                async for output in self._outputs(f"{request_id}-{i}", prompt, params):
                    queue.put_nowait((i, output))
            except BaseException as e:
                queue.put_nowait(e)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
        sent: dict[tuple[int, int], int] = {}
        done = 0
        extension = {"vlmserve": self._extension(prompts, with_prompt_index=True)}  # on the first chunk
        try:
            while done < len(tasks):
                item = await queue.get()
                if item is None:
                    done += 1
                    continue
                if isinstance(item, APIError):
                    yield _sse(item.body())
                    break
                if isinstance(item, BaseException):
                    raise item
                i, output = item
                for c in output.outputs:
                    key = (i, c.index)
                    delta = c.text[sent.get(key, 0) :]
                    if delta or c.finish_reason is not None:
                        sent[key] = len(c.text)
                        first, extension = extension, {}
                        yield _sse(
                            base
                            | first
                            | {
                                "choices": [
                                    {
                                        "index": i * params.n + c.index,
                                        "text": delta,
                                        "logprobs": None,
                                        "finish_reason": c.finish_reason,
                                    }
                                ]
                            }
                        )
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()

    def _legacy_logprobs(self, choice: CompletionOutput) -> dict[str, Any] | None:
        if choice.logprobs is None:
            return None
        tokens, token_logprobs, top = [], [], []
        for token_id, entry in zip(choice.token_ids, choice.logprobs, strict=True):
            tokens.append(entry[token_id].decoded_token)
            token_logprobs.append(entry[token_id].logprob)
            top.append({lp.decoded_token: lp.logprob for lp in entry.values()})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
