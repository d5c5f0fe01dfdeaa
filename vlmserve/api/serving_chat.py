"""POST /v1/chat/completions once its prompt is built: one engine request (its n samples as the
choices), answered as a `chat.completion`, or streamed as `chat.completion.chunk` events (a role
chunk per choice first, the `vlmserve` extension on the first; then text and logprob deltas;
usage last when `stream_options.include_usage` asks for it; an engine error as an error event)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from vlmserve.api.chat_output import ChatParsing
from vlmserve.api.echo import chat_echo, prompt_logprobs_json, with_echo
from vlmserve.api.protocol import APIError, ChatCompletionRequest
from vlmserve.api.responses import chat_logprobs, extension, response_id, running_usage, usage
from vlmserve.api.serving import EngineServing
from vlmserve.api.streaming import SentChoices, continuous_usage, sse_stream, started, usage_so_far
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import RequestOutput
from vlmserve.sampling_params import SamplingParams


class ChatServing(EngineServing):
    def parsing(self, body: ChatCompletionRequest) -> ChatParsing:
        """How the request's choices are parsed (reasoning, tool calls): a 400 when the server
        was not started to parse what it asks."""
        try:
            return ChatParsing.for_request(
                body.tools,
                body.effective_tool_choice,
                body.chat_template_kwargs,
                body.include_reasoning,
                body.parallel_tool_calls,
                self.ctx.reasoning_parser,
                self.ctx.tool_call_parser,
                self.ctx.enable_auto_tool_choice,
            )
        except ValueError as e:
            raise APIError(400, str(e), "tool_choice") from None

    async def response(
        self, body: ChatCompletionRequest, prompt: ProcessedPrompt, params: SamplingParams, parsing: ChatParsing
    ) -> dict[str, Any]:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        final = await self._last(request_id, prompt, params, self._beam(body, params))
        tokenizer = self.ctx.frontend.tokenizer
        token_ids = bool(body.return_token_ids)
        as_ids = bool(body.return_tokens_as_token_ids)
        echo = chat_echo(body.messages, body.add_generation_prompt) if body.echo else ""
        response = {
            "id": response_id("chatcmpl", body.request_id, request_id),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.ctx.response_model(),
            "choices": [
                {
                    "index": c.index,
                    "message": with_echo(message, echo),
                    "logprobs": chat_logprobs(c, 0, params.logprobs or 0, tokenizer, as_ids),
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
                | ({"token_ids": list(c.token_ids)} if token_ids else {})
                for c in final.outputs
                for message, finish_reason in [parsing.message(c.text, c.finish_reason)]
            ],
            "usage": usage(prompt, final, parsing.reasoning_tokens(final.outputs, tokenizer)),
            "vlmserve": extension([prompt], self.grounding_convention, finals=[final]),
        }
        if token_ids:  # vLLM's return_token_ids
            response["prompt_token_ids"] = list(final.prompt_token_ids)
        # null where not asked for: vLLM's field is always there, and clients read it
        response["prompt_logprobs"] = (
            None if final.prompt_logprobs is None else prompt_logprobs_json(final.prompt_logprobs)
        )
        return response

    async def stream(
        self, body: ChatCompletionRequest, prompt: ProcessedPrompt, params: SamplingParams, parsing: ChatParsing
    ) -> AsyncIterator[str]:
        """The response's events; with structured outputs (a forced tool call too), once the engine
        has taken the request (a grammar that does not compile is a 400, not an error event)."""
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        tokenizer = self.ctx.frontend.tokenizer
        outputs = self._outputs(request_id, prompt, params, self._beam(body, params))
        if params.structured_outputs is not None:
            outputs = await started(outputs)
        base = {
            "id": response_id("chatcmpl", body.request_id, request_id),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.ctx.response_model(),
        }
        final: list[RequestOutput] = []  # the last output, once there is one
        return sse_stream(
            self._chunks(outputs, base, body, prompt, params, parsing, final),
            body.stream_options,
            lambda: (
                base
                | {
                    "choices": [],
                    "usage": usage(prompt, final[0], parsing.reasoning_tokens(final[0].outputs, tokenizer)),
                }
                if final
                else None
            ),
        )

    async def _chunks(
        self,
        outputs: AsyncGenerator[RequestOutput, None],
        base: dict[str, Any],
        body: ChatCompletionRequest,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        parsing: ChatParsing,
        final: list[RequestOutput],
    ) -> AsyncGenerator[dict[str, Any], None]:
        """A role chunk per choice (the `vlmserve` extension on the first), the echo, then each
        output's text, tool-call and logprob deltas."""
        token_ids = bool(body.return_token_ids)
        tokenizer = self.ctx.frontend.tokenizer
        parsers = [parsing.stream() if parsing.active else None for _ in range(params.n)]
        continuous = continuous_usage(body.stream_options)
        for i in range(params.n):
            role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            first: dict[str, Any] = {"vlmserve": extension([prompt], self.grounding_convention)} if i == 0 else {}
            if i == 0 and token_ids:  # vLLM: the prompt's ids ride on the first chunk
                first["prompt_token_ids"] = list(prompt.prompt_token_ids)
            if continuous:
                first["usage"] = running_usage(len(prompt.prompt_token_ids), 0)
            yield base | {"choices": [role]} | first
        echo = chat_echo(body.messages, body.add_generation_prompt) if body.echo else ""
        if echo:  # vLLM: the echoed content in a chunk of its own per choice
            for i in range(params.n):
                yield base | {
                    "choices": [{"index": i, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}]
                }
        as_ids = bool(body.return_tokens_as_token_ids)
        sent = SentChoices()
        async with aclosing(outputs):
            async for output in outputs:
                final[:] = [output]
                choices = []
                for c in output.outputs:
                    if not sent.has_news(c.index, c):
                        continue
                    delta = sent.take(c.index, c)
                    logprobs = chat_logprobs(c, delta.token_start, params.logprobs or 0, tokenizer, as_ids)
                    parser = parsers[c.index]
                    finish_reason = c.finish_reason
                    if parser is None:
                        message = {"content": delta.text} if delta.text else {}
                    else:
                        message = parser.feed(delta.text, final=finish_reason is not None)
                        finish_reason = parser.finish_reason(finish_reason)
                    choices.append(
                        {"index": c.index, "delta": message, "logprobs": logprobs, "finish_reason": finish_reason}
                        | ({"token_ids": delta.token_ids} if token_ids else {})
                    )
                if choices:
                    yield base | {"choices": choices} | (usage_so_far(output) if continuous else {})
