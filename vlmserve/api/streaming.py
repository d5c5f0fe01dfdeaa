"""What a streamed chat or completion response does the same way whatever the endpoint: the SSE
framing (each chunk an event; an engine error as an error event, then the end; usage last where
`stream_options.include_usage` asks for it; `data: [DONE]`), what has been sent of each choice
(its text and token ids, so each chunk carries only what is new), and vLLM's
continuous_usage_stats (the usage so far on every chunk); and an engine request started before
its stream is, where starting can fail on the request (`started`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Hashable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from vlmserve.api.protocol import APIError, StreamOptions
from vlmserve.api.responses import SSE_DONE, running_usage, sse
from vlmserve.outputs import CompletionOutput, RequestOutput


@dataclass(frozen=True)
class ChoiceDelta:
    """What is new in a choice since its last chunk."""

    text: str
    token_ids: list[int]
    text_start: int  # characters of the choice's text sent before
    token_start: int  # its tokens sent before (where the new logprobs start)
    first: bool  # nothing of the choice has been sent yet


class SentChoices:
    """What a stream has sent of each of its choices (keyed as the endpoint numbers them)."""

    def __init__(self) -> None:
        self._text: dict[Hashable, int] = {}
        self._tokens: dict[Hashable, int] = {}

    def take(self, key: Hashable, choice: CompletionOutput) -> ChoiceDelta:
        """The choice's new text and tokens, now counted as sent."""
        text_start, token_start = self._text.get(key, 0), self._tokens.get(key, 0)
        delta = ChoiceDelta(
            choice.text[text_start:],
            list(choice.token_ids[token_start:]),
            text_start,
            token_start,
            key not in self._text,
        )
        self._text[key], self._tokens[key] = len(choice.text), len(choice.token_ids)
        return delta

    def has_sent(self, key: Hashable) -> bool:
        return key in self._text

    def has_news(self, key: Hashable, choice: CompletionOutput) -> bool:
        """Whether the choice has new text, or has just finished."""
        return len(choice.text) > self._text.get(key, 0) or choice.finish_reason is not None


async def started(outputs: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[RequestOutput, None]:
    """`outputs` once its first output has come. A request with structured outputs is refused by
    the engine when its grammar does not compile (or takes too long to): started first, such a
    request gets an HTTP 400 before any event is sent, as without stream, not an error event
    inside a stream that began with 200. Closed (its engine request aborted) if this fails or is
    cancelled."""
    try:
        first = await anext(outputs)
    except BaseException:
        await outputs.aclose()
        raise

    async def replay() -> AsyncGenerator[RequestOutput, None]:
        async with aclosing(outputs):
            yield first
            async for output in outputs:
                yield output

    return replay()


def continuous_usage(options: StreamOptions | None) -> bool:
    """vLLM's continuous_usage_stats: the usage so far on every chunk (with include_usage)."""
    return bool(options and options.include_usage and options.continuous_usage_stats)


def usage_so_far(output: RequestOutput) -> dict[str, Any]:
    return {"usage": running_usage(len(output.prompt_token_ids), sum(len(o.token_ids) for o in output.outputs))}


async def sse_stream(
    chunks: AsyncGenerator[dict[str, Any], None],
    options: StreamOptions | None,
    final_usage: Callable[[], dict[str, Any] | None],
) -> AsyncIterator[str]:
    """The chunks as server-sent events: an APIError raised while they are made ends the stream
    with its error event (no usage); after the last chunk, the usage chunk final_usage() gives
    (None: none) where include_usage asks for it; then the end."""
    # NOTE: closing this stream (the client went away) closes the chunks' generator at once, and
    # with it the engine requests it reads (they are aborted).
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except APIError as e:
            yield sse(e.body())
            yield SSE_DONE
            return
    if options and options.include_usage:
        last = final_usage()
        if last is not None:
            yield sse(last)
    yield SSE_DONE
