"""POST /v1/completions once its prompts are built: one engine request per prompt, run side by
side, choice `i * n + k` being prompt i's sample k. Answered as one `text_completion` (usage
summed over the prompts, legacy logprobs), or streamed as text deltas in the order the engine
produces them (the `vlmserve` extension on the first chunk; usage, summed over the prompts, last
when `stream_options.include_usage` asks for it; an engine error as an error event)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from vlmserve.api.echo import echoed_logprobs, prompt_logprobs_json, prompt_text
from vlmserve.api.protocol import CompletionRequest
from vlmserve.api.responses import completion_logprobs, extension, response_id, usage
from vlmserve.api.serving import EngineServing
from vlmserve.api.streaming import SentChoices, continuous_usage, sse_stream, started, usage_so_far
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import RequestOutput
from vlmserve.sampling_params import SamplingParams


class CompletionServing(EngineServing):
    async def response(
        self, body: CompletionRequest, prompts: list[ProcessedPrompt], params: SamplingParams
    ) -> dict[str, Any]:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        token_ids = bool(body.return_token_ids)
        beam = self._beam(body, params)
        finals = await asyncio.gather(
            *(self._last(f"{request_id}-{i}", p, params, beam) for i, p in enumerate(prompts))
        )
        tokenizer = self.ctx.frontend.tokenizer
        as_ids = bool(body.return_tokens_as_token_ids)
        choices = []
        for i, final in enumerate(finals):
            echo = prompt_text(prompts[i], tokenizer) if body.echo else ""
            for c in final.outputs:
                choices.append(
                    {
                        "index": i * params.n + c.index,
                        "text": echo + c.text,
                        "logprobs": echoed_logprobs(final, c, tokenizer, as_ids)
                        if body.echo
                        else completion_logprobs(c, as_token_ids=as_ids),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    | (
                        {"prompt_token_ids": list(final.prompt_token_ids), "token_ids": list(c.token_ids)}
                        if token_ids
                        else {}
                    )
                    # null where not asked for: vLLM's field is always there, and clients read it
                    | {
                        "prompt_logprobs": None
                        if final.prompt_logprobs is None
                        else prompt_logprobs_json(final.prompt_logprobs)
                    }
                )
        return {
            "id": response_id("cmpl", body.request_id, request_id),
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.ctx.response_model(),
            "choices": choices,
            "usage": _total_usage(prompts, finals),
            "vlmserve": extension(prompts, self.grounding_convention, with_prompt_index=True, finals=finals),
        }

    async def stream(
        self, body: CompletionRequest, prompts: list[ProcessedPrompt], params: SamplingParams
    ) -> AsyncIterator[str]:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        base = {
            "id": response_id("cmpl", body.request_id, request_id),
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.ctx.response_model(),
        }
        finals: dict[int, RequestOutput] = {}

        def usage_chunk() -> dict[str, Any] | None:
            if len(finals) < len(prompts):
                return None
            return base | {"choices": [], "usage": _total_usage(prompts, [finals[i] for i in range(len(prompts))])}

        beam = self._beam(body, params)
        outputs = [self._outputs(f"{request_id}-{i}", p, params, beam) for i, p in enumerate(prompts)]
        if params.structured_outputs is not None:
            # The prompts share the grammar: the engine taking the first takes them all (a grammar
            # that does not compile is a 400 before the stream, as in chat).
            try:
                outputs[0] = await started(outputs[0])
            except BaseException:
                for unstarted in outputs[1:]:
                    await unstarted.aclose()
                raise
        return sse_stream(self._chunks(outputs, base, body, prompts, params, finals), body.stream_options, usage_chunk)

    async def _chunks(
        self,
        outputs: list[AsyncGenerator[RequestOutput, None]],
        base: dict[str, Any],
        body: CompletionRequest,
        prompts: list[ProcessedPrompt],
        params: SamplingParams,
        finals: dict[int, RequestOutput],
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Text deltas in the order the engine produces them, over every prompt's samples (the
        `vlmserve` extension on the first chunk, each choice's echo on its first)."""
        continuous = continuous_usage(body.stream_options)
        token_ids = bool(body.return_token_ids)
        tokenizer = self.ctx.frontend.tokenizer
        as_ids = bool(body.return_tokens_as_token_ids)
        echoes = [prompt_text(p, tokenizer) if body.echo else "" for p in prompts]
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(i: int, source: AsyncGenerator[RequestOutput, None]) -> None:
            try:
                async with aclosing(source):
                    async for output in source:
                        queue.put_nowait((i, output))
            except BaseException as e:
                queue.put_nowait(e)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(i, source)) for i, source in enumerate(outputs)]
        sent = SentChoices()
        done = 0
        # The extension rides on the first chunk.
        first_extension = {"vlmserve": extension(prompts, self.grounding_convention, with_prompt_index=True)}
        try:
            while done < len(tasks):
                item = await queue.get()
                if item is None:
                    done += 1
                    continue
                if isinstance(item, BaseException):
                    raise item  # an APIError ends the stream with its error event
                i, output = item
                finals[i] = output
                for c in output.outputs:
                    key = (i, c.index)
                    echo = echoes[i] if not sent.has_sent(key) else ""  # vLLM: the prompt on the first chunk
                    if not (echo or sent.has_news(key, c)):
                        continue
                    delta = sent.take(key, c)
                    if echo:
                        logprobs = echoed_logprobs(output, c, tokenizer, as_ids)
                    else:
                        logprobs = completion_logprobs(c, delta.token_start, len(echoes[i]) + delta.text_start, as_ids)
                    choice = {
                        "index": i * params.n + c.index,
                        "text": echo + delta.text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                    }
                    if token_ids:  # vLLM: the prompt's ids on a choice's first chunk, then new ids
                        if delta.first:
                            choice["prompt_token_ids"] = list(output.prompt_token_ids)
                        choice["token_ids"] = delta.token_ids
                    first, first_extension = first_extension, {}
                    yield base | first | (usage_so_far(output) if continuous else {}) | {"choices": [choice]}
        finally:
            for task in tasks:
                task.cancel()


def _total_usage(prompts: list[ProcessedPrompt], finals: list[RequestOutput]) -> dict[str, Any]:
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = 0
    for prompt, final in zip(prompts, finals, strict=True):
        part = usage(prompt, final)
        for key in total:
            total[key] += part[key]
        cached += part["prompt_tokens_details"]["cached_tokens"]
    return total | {"prompt_tokens_details": {"cached_tokens": cached}}
