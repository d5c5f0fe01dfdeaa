"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it) once its prompt is built: one
engine request, answered as a `response` object, or streamed as its typed events
(response.created, response.in_progress, the output items' events, then response.completed, or
response.incomplete when max_output_tokens cut the answer; an engine error as an `error` event).

A request runs as the chat request its conversation makes (responses_protocol.py): the same
prompt, sampling, structured outputs, tool calls (`--tool-call-parser`) and reasoning
(`--reasoning-parser`). With `store` (the default, as OpenAI's) the response is kept in the
bounded store (response_store.py) with its conversation, for GET /v1/responses/{id} and for a
later request's `previous_response_id`."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from vlmserve.api.chat_output import ChatParsing
from vlmserve.api.prompts import PromptBuilder
from vlmserve.api.protocol import APIError, ChatCompletionRequest
from vlmserve.api.reasoning import ThinkReasoningParser
from vlmserve.api.response_store import ResponseStore
from vlmserve.api.responses import extension
from vlmserve.api.responses_output import Event, OutputWriter, response_usage, whole_output
from vlmserve.api.responses_protocol import ResponsesRequest, renamed
from vlmserve.api.serving import EngineServing, ServingContext
from vlmserve.api.serving_chat import ChatServing
from vlmserve.api.streaming import SentChoices, started
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import RequestOutput
from vlmserve.sampling_params import SamplingParams

THINK_END = ThinkReasoningParser.END


@dataclass(frozen=True)
class ResponseRun:
    """One Responses request made ready to run: its conversation (the stored one's items, then
    this request's), the chat request it runs as, and how its answer is parsed."""

    body: ResponsesRequest
    conversation: list[dict[str, Any]]
    chat: ChatCompletionRequest
    parsing: ChatParsing
    response_id: str
    created_at: int


class ResponsesServing(EngineServing):
    def __init__(self, ctx: ServingContext, store: ResponseStore, chat_serving: ChatServing) -> None:
        """`chat_serving`: the chat endpoint's, whose parsing a response's answer gets."""
        super().__init__(ctx)
        self.store = store
        self.chat_serving = chat_serving
        self.defaults = ctx.frontend.default_sampling_params()

    def prepare(self, body: ResponsesRequest) -> ResponseRun:
        """The conversation (a 404 naming previous_response_id when it is not stored) and the
        chat request it makes (400s named in the Responses fields)."""
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = self.store.get(body.previous_response_id, "previous_response_id").conversation
        conversation = history + body.input_items()
        chat = body.chat_request(conversation, first=len(history))
        parsing = self.chat_serving.parsing(chat)
        return ResponseRun(body, conversation, chat, parsing, f"resp_{uuid.uuid4().hex}", int(time.time()))

    async def prompt(self, prompt_builder: PromptBuilder, run: ResponseRun) -> tuple[ProcessedPrompt, SamplingParams]:
        """The chat request's prompt and sampling params, its errors named in the Responses fields."""
        try:
            return await prompt_builder.chat(run.chat)
        except APIError as e:
            raise renamed(e) from None

    async def create(self, run: ResponseRun, prompt: ProcessedPrompt, params: SamplingParams) -> dict[str, Any]:
        final = await self._last(run.response_id, prompt, params)
        choice = final.outputs[0]
        message, _ = run.parsing.message(choice.text, choice.finish_reason)
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        output = whole_output(message, status)
        response = self._response(run, prompt, status, output, final)
        self._keep(run, response)
        return response

    async def stream(self, run: ResponseRun, prompt: ProcessedPrompt, params: SamplingParams) -> AsyncIterator[str]:
        """The response's events; with structured outputs (text.format, a forced call), once the
        engine has taken the request (a grammar that does not compile is a 400, not an error event)."""
        outputs = self._outputs(run.response_id, prompt, params)
        if params.structured_outputs is not None:
            outputs = await started(outputs)
        return _sse(self._events(run, prompt, outputs))

    async def _events(
        self, run: ResponseRun, prompt: ProcessedPrompt, outputs: AsyncGenerator[RequestOutput, None]
    ) -> AsyncGenerator[Event, None]:
        started = self._response(run, prompt, "in_progress", [], None)
        yield {"type": "response.created", "response": started}
        yield {"type": "response.in_progress", "response": started}
        writer = OutputWriter()
        parser = run.parsing.stream()
        sent = SentChoices()
        final: RequestOutput | None = None
        async with aclosing(outputs):  # the client gone: the engine request is aborted at once
            async for output in outputs:
                final = output
                choice = output.outputs[0]
                if sent.has_news(0, choice):
                    delta = sent.take(0, choice)
                    for event in writer.feed(parser.feed(delta.text, final=choice.finish_reason is not None)):
                        yield event
        assert final is not None
        status = "incomplete" if final.outputs[0].finish_reason == "length" else "completed"
        for event in writer.close(status):
            yield event
        response = self._response(run, prompt, status, writer.items, final)
        self._keep(run, response)
        yield {"type": f"response.{status}", "response": response}

    def _response(
        self,
        run: ResponseRun,
        prompt: ProcessedPrompt,
        status: str,
        output: list[dict[str, Any]],
        final: RequestOutput | None,
    ) -> dict[str, Any]:
        body = run.body
        text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text else {"format": {"type": "text"}}
        return {
            "id": run.response_id,
            "object": "response",
            "created_at": run.created_at,
            "status": status,
            "completed_at": int(time.time()) if final is not None else None,
            "model": self.ctx.response_model(),
            "output": output,
            "instructions": body.instructions,
            "previous_response_id": body.previous_response_id,
            # As asked, else the checkpoint's generation_config default (params may hold what
            # greedy sampling made of them).
            "temperature": body.temperature if body.temperature is not None else self.defaults.temperature,
            "top_p": body.top_p if body.top_p is not None else self.defaults.top_p,
            "max_output_tokens": body.max_output_tokens,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.function_tools()],
            "tool_choice": body.tool_choice_shown,
            "parallel_tool_calls": body.parallel_tool_calls,
            "text": text,
            "reasoning": body.reasoning.model_dump() if body.reasoning else None,
            "store": body.store,
            "truncation": "disabled",
            "background": False,
            "metadata": body.metadata or {},
            "user": body.user,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": None if final is None else response_usage(prompt, final, self._reasoning_tokens(output, final)),
            "vlmserve": extension([prompt], self.grounding_convention, finals=None if final is None else [final]),
        } | self._token_ids(run, prompt, final)

    @staticmethod
    def _token_ids(run: ResponseRun, prompt: ProcessedPrompt, final: RequestOutput | None) -> dict[str, Any]:
        """vLLM's return_token_ids extension (as on chat): the prompt's ids, and the answer's once it is done."""
        if not run.chat.return_token_ids:
            return {}
        output = None if final is None else list(final.outputs[0].token_ids)
        return {"prompt_token_ids": list(prompt.prompt_token_ids), "output_token_ids": output}

    def _reasoning_tokens(self, output: list[dict[str, Any]], final: RequestOutput) -> int:
        """The answer's tokens up to and with the one that completes `</think>` (all of them if it
        never came): the shortest prefix whose text holds it, found by bisection (a tokenizer may
        write the tag as one token or as several)."""
        if not any(item["type"] == "reasoning" for item in output):
            return 0
        token_ids = list(final.outputs[0].token_ids)
        decode = self.ctx.frontend.tokenizer.decode
        if THINK_END not in decode(token_ids, False):
            return len(token_ids)
        low, high = 1, len(token_ids)  # invariant: the prefix of `high` tokens holds the tag
        while low < high:
            middle = (low + high) // 2
            if THINK_END in decode(token_ids[:middle], False):
                high = middle
            else:
                low = middle + 1
        return high

    def _keep(self, run: ResponseRun, response: dict[str, Any]) -> None:
        if run.body.store:
            self.store.put(response, run.conversation + response["output"])


async def _sse(events: AsyncGenerator[Event, None]) -> AsyncIterator[str]:
    """The events as server-sent events, `event:` naming each type and `sequence_number` counting
    them; an APIError raised while they are made ends the stream with an `error` event."""
    sequence = 0
    # NOTE: closing this stream (the client went away) closes the events' generator at once, and
    # with it the engine request (it is aborted).
    async with aclosing(events):
        try:
            async for event in events:
                yield _framed(event | {"sequence_number": sequence})
                sequence += 1
        except APIError as e:
            error = {"type": "error", "code": e.code, "message": e.message, "param": e.param}
            yield _framed(error | {"sequence_number": sequence})


def _framed(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
