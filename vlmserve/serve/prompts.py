"""A request body becomes what the engine takes: processed prompts and sampling params. Text is
checked (valid Unicode, no NUL), max_tokens and the number of prompts bounded, chat messages
rendered; media is fetched through the guarded fetcher (the counts checked before anything is
fetched) and the processor runs in a worker thread. Every problem is a 400 naming the parameter."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.multimodal.media import MediaError
from vlmserve.processor.base import ImageInput, VideoInput
from vlmserve.sampling_params import SamplingParams
from vlmserve.serve.fetch import FetchError, FetchPolicy, fetch
from vlmserve.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, check_text
from vlmserve.serve.serving import ServingContext


def _walk_text(value: Any, param: str) -> None:
    if isinstance(value, str):
        check_text(value, param)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _walk_text(v, f"{param}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            _walk_text(v, f"{param}.{k}")


class PromptBuilder:
    """Each endpoint's request body as (processed prompt(s), sampling params)."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.frontend = ctx.frontend

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
