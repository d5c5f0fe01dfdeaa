"""A chat choice's text as the message the client gets: its reasoning (`--reasoning-parser`) and
its tool calls (tool_choice) parsed out, whole or streamed as deltas. As vLLM: the reasoning is
split off first, then the tool calls are read from the content.

With a tool_choice that forces a call, the grammar constrains the answer from its first token,
so there is no reasoning part to split off: the reasoning parser is not applied (vLLM lets a
thinking model reason first and constrains only what follows `</think>`), except for calls in
Qwen3.5's format, whose grammar lets a thinking answer reason first (tool_calling.py,
reasons_before_forced_calls). With tool_choice auto, a call the model starts inside its reasoning
ends the reasoning (reasoning.py): it comes back as a call, never as reasoning text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vlmserve.api.reasoning import ThinkReasoningParser, thinking_enabled
from vlmserve.api.tool_calling import NamedToolChoice, ToolParser, reasons_before_forced_calls, tool_parser
from vlmserve.api.tool_parsers import (
    ContentDelta,
    HermesToolParser,
    StreamEvent,
    ToolCallDelta,
    new_call_id,
)
from vlmserve.api.xml_tool_parser import XmlToolParser
from vlmserve.outputs import CompletionOutput
from vlmserve.tokenizer import AnyTokenizer


@dataclass(frozen=True)
class ChatParsing:
    """What a request's choices are parsed with (both None: the text is the content)."""

    reasoning: ThinkReasoningParser | None
    tools: ToolParser | None
    include_reasoning: bool = True
    parallel_tool_calls: bool = True
    # The answer is a forced tool call (tool_choice "required" or a named function), in any format.
    forced: bool = False
    named: bool = False  # a named function

    @classmethod
    def for_request(
        cls,
        tools: Any,
        tool_choice: Any,
        chat_template_kwargs: dict[str, Any] | None,
        include_reasoning: bool,
        parallel_tool_calls: bool,
        reasoning_parser: str | None,
        tool_call_parser: str | None,
        enable_auto_tool_choice: bool,
    ) -> ChatParsing:
        """ValueError (naming the field) when the server cannot parse what the request asks."""
        tool = tool_parser(tools, tool_choice, tool_call_parser, enable_auto_tool_choice)
        named = bool(tools) and isinstance(tool_choice, NamedToolChoice)
        forced = named or (bool(tools) and tool_choice == "required")
        thinking = thinking_enabled(chat_template_kwargs)
        reasoning = None
        if forced and reasons_before_forced_calls(tool_call_parser, reasoning_parser, thinking):
            reasoning = ThinkReasoningParser()  # the grammar: reasoning, `</think>`, then the calls
        elif reasoning_parser is not None and not forced:
            call_start = tool.START if isinstance(tool, HermesToolParser | XmlToolParser) else None
            reasoning = ThinkReasoningParser(thinking_enabled=thinking, call_start=call_start)
        return cls(reasoning, tool, include_reasoning, parallel_tool_calls, forced, named)

    def reasoning_tokens(self, choices: Sequence[CompletionOutput], tokenizer: AnyTokenizer) -> int | None:
        """How many of the choices' tokens were reasoning (None: no reasoning parser read them):
        each token that begins inside a choice's reasoning text (after a leading `<think>`,
        before `</think>`), counted by the bytes each token stands for."""
        if self.reasoning is None:
            return None
        count = 0
        for choice in choices:
            start, end = self.reasoning.span(choice.text)
            first, last = len(choice.text[:start].encode()), len(choice.text[:end].encode())
            offset = 0
            for token_id in choice.token_ids:
                count += first <= offset < last
                offset += len(tokenizer.token_bytes(token_id))
        return count

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The choice's message and its finish_reason ("tool_calls" when it called tools)."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        content: str | None = text
        if self.reasoning is not None:
            split = self.reasoning.parse(text)
            content = split.content
            if self.include_reasoning:
                # vLLM's field is `reasoning` now; `reasoning_content` is its former name, kept.
                message["reasoning"] = message["reasoning_content"] = split.reasoning
        if self.tools is not None and content is not None:
            parsed = self.tools.parse(content)
            calls = parsed.tool_calls if self.parallel_tool_calls else parsed.tool_calls[:1]
            content = parsed.content
            if calls:
                message["tool_calls"] = [
                    {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls
                ]
                finish_reason = _finish_with_calls(self.named, finish_reason)
                if self.forced:  # vLLM's: a forced call's content is "", not null
                    content = content or ""
        message["content"] = content
        return message, finish_reason

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


def _finish_with_calls(named: bool, finish_reason: str | None) -> str | None:
    """A choice's finish_reason when it called tools: "tool_calls" where it stopped, except for a
    named function ("stop", as OpenAI's API and vLLM answer)."""
    if finish_reason == "stop" and not named:
        return "tool_calls"
    return finish_reason


class ChoiceStream:
    """One choice's text deltas as OpenAI delta objects (content, reasoning_content, tool_calls)."""

    def __init__(self, parsing: ChatParsing) -> None:
        self.parsing = parsing
        self.reasoning = parsing.reasoning.stream() if parsing.reasoning is not None else None
        self.tools = parsing.tools.stream() if parsing.tools is not None else None
        self.ids: dict[int, str] = {}

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def finish_reason(self, finish_reason: str | None) -> str | None:
        """The choice's finish_reason, as the whole message gives it."""
        if not self.called or self.parsing.tools is None:
            return finish_reason
        return _finish_with_calls(self.parsing.named, finish_reason)

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        delta: dict[str, Any] = {}
        if reasoning and self.parsing.include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if self.tools is None:
            if content:
                delta["content"] = content
            return delta
        events: list[StreamEvent] = self.tools.feed(content) if content else []
        if final:
            events += self.tools.finish()
        texts = "".join(e.text for e in events if isinstance(e, ContentDelta))
        if texts:
            delta["content"] = texts
        calls = [self._call(e) for e in events if isinstance(e, ToolCallDelta)]
        calls = [c for c in calls if c is not None]
        if calls:
            delta["tool_calls"] = calls
        return delta

    def _call(self, event: ToolCallDelta) -> dict[str, Any] | None:
        if event.index > 0 and not self.parsing.parallel_tool_calls:
            return None
        if event.name is not None:
            self.ids[event.index] = new_call_id()
            return {
                "index": event.index,
                "id": self.ids[event.index],
                "type": "function",
                "function": {"name": event.name, "arguments": event.arguments},
            }
        return {"index": event.index, "function": {"arguments": event.arguments}}
