"""A response's output items (OpenAI's Responses API), whole or streamed: its reasoning as a
`reasoning` item, its text as a `message` item, each tool call as a `function_call` item, in the
order the answer gives them; and the typed events that build them one delta at a time
(response.output_item.added, response.content_part.added, response.output_text.delta, ...,
response.output_item.done), which the official client puts together into the same items.

A whole answer is written as one delta: both paths make the items the same way."""

from __future__ import annotations

import uuid
from typing import Any

from vlmserve.api.responses import multimodal_tokens
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import RequestOutput

Event = dict[str, Any]


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputWriter:
    """The output items of one answer, built from chat deltas ({"reasoning_content", "content",
    "tool_calls"}, as chat_output.ChoiceStream gives them), with the events that build them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text = ""  # the open item's text (a call's: its arguments)

    def feed(self, delta: dict[str, Any]) -> list[Event]:
        events = []
        if delta.get("reasoning_content"):
            events += self._add_text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._add_text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if "id" in call:  # a call's first delta: a new item
                events += self._close("completed")
                events += self._start(
                    {
                        "id": item_id("fc"),
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": function.get("name", ""),
                        "arguments": "",
                        "status": "in_progress",
                    }
                )
            if function.get("arguments") and self._open is not None:
                self._text += function["arguments"]
                events.append(self._event("response.function_call_arguments.delta", delta=function["arguments"]))
        return events

    def close(self, status: str) -> list[Event]:
        """The last item finished with `status` (completed, or incomplete when the answer was cut
        short); an answer with no item at all gets an empty message, as OpenAI's does."""
        events = []
        if self._open is None and not self.items:
            events += self._start(_message(""))
        return events + self._close(status)

    def _add_text(self, kind: str, text: str) -> list[Event]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            events += self._start(_message("") if kind == "message" else _reasoning(""))
        self._text += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, content_index=0, delta=text, **extra))
        return events

    def _start(self, item: dict[str, Any]) -> list[Event]:
        self._open, self._text = item, ""
        self.items.append(item)
        events = [self._event("response.output_item.added", item=dict(item) | _empty(item))]
        if item["type"] != "function_call":
            events.append(self._event("response.content_part.added", content_index=0, part=_part(item["type"], "")))
        return events

    def _close(self, status: str) -> list[Event]:
        item = self._open
        if item is None:
            return []
        text = self._text
        events = []
        if item["type"] == "function_call":
            item["arguments"] = text
            events.append(self._event("response.function_call_arguments.done", arguments=text, name=item["name"]))
        else:
            part = _part(item["type"], text)
            item["content"] = [part]
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra: dict[str, Any] = {"logprobs": []} if item["type"] == "message" else {}
            events.append(self._event(done, content_index=0, text=text, **extra))
            events.append(self._event("response.content_part.done", content_index=0, part=part))
        item["status"] = status
        events.append(self._event("response.output_item.done", item=dict(item)))
        self._open, self._text = None, ""
        return events

    def _event(self, kind: str, **fields: Any) -> Event:
        assert self._open is not None
        output_index = self.items.index(self._open)
        if "item" in fields:
            return {"type": kind, "output_index": output_index, **fields}
        return {"type": kind, "item_id": self._open["id"], "output_index": output_index, **fields}


def _message(text: str) -> dict[str, Any]:
    return {
        "id": item_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": "in_progress",
        "content": [_part("message", text)],
    }


def _reasoning(text: str) -> dict[str, Any]:
    return {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [_part("reasoning", text)]}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _empty(item: dict[str, Any]) -> dict[str, Any]:
    """What an item shows when it is added: no content yet."""
    return {} if item["type"] == "function_call" else {"content": []}


def whole_output(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A chat message (chat_output.ChatParsing.message) as output items."""
    writer = OutputWriter()
    writer.feed(message)
    writer.close(status)
    return writer.items


def response_usage(prompt: ProcessedPrompt, final: RequestOutput, reasoning_tokens: int) -> dict[str, Any]:
    """OpenAI's Responses usage, with each image's tokens (the extension the chat usage has too)."""
    output_tokens = sum(len(o.token_ids) for o in final.outputs)
    input_tokens = len(final.prompt_token_ids)
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": final.num_cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
        "multimodal_tokens": multimodal_tokens(prompt),
    }
