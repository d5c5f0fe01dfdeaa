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

from dataclasses import dataclass
from typing import Any

from vlmserve.api.reasoning import ThinkReasoningParser, thinking_enabled
from vlmserve.api.tool_calling import NamedToolChoice, ToolParser, reasons_before_forced_calls, tool_parser
from vlmserve.api.tool_parsers import ContentDelta, HermesToolParser, StreamEvent, ToolCallDelta, new_call_id
from vlmserve.api.xml_tool_parser import XmlToolParser


@dataclass(frozen=True)
class ChatParsing:
    """What a request's choices are parsed with (both None: the text is the content)."""

    reasoning: ThinkReasoningParser | None
    tools: ToolParser | None
    include_reasoning: bool = True
    parallel_tool_calls: bool = True

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
        forced = bool(tools) and (isinstance(tool_choice, NamedToolChoice) or tool_choice == "required")
        thinking = thinking_enabled(chat_template_kwargs)
        reasoning = None
        if forced and reasons_before_forced_calls(tool_call_parser, reasoning_parser, thinking):
            reasoning = ThinkReasoningParser()  # the grammar: reasoning, `</think>`, then the calls
        elif reasoning_parser is not None and not forced:
            call_start = tool.START if isinstance(tool, HermesToolParser | XmlToolParser) else None
            reasoning = ThinkReasoningParser(thinking_enabled=thinking, call_start=call_start)
        return cls(reasoning, tool, include_reasoning, parallel_tool_calls)

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
                message["reasoning_content"] = split.reasoning
        if self.tools is not None and content is not None:
            parsed = self.tools.parse(content)
            calls = parsed.tool_calls if self.parallel_tool_calls else parsed.tool_calls[:1]
            content = parsed.content
            if calls:
                message["tool_calls"] = [
                    {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls
                ]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        message["content"] = content
        return message, finish_reason

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


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

    def feed(self, text: str, final: bool) -> dict[str, Any]:
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        delta: dict[str, Any] = {}
        if reasoning and self.parsing.include_reasoning:
            delta["reasoning_content"] = reasoning
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
