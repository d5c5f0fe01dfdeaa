"""A thinking model's answer split into its reasoning and its content, whole or streamed
(vLLM's `--reasoning-parser qwen3`).

Qwen3's thinking checkpoints write `<think>reasoning</think>content`; their templates (Qwen3-VL
-Thinking, Qwen3.5) put `<think>` in the prompt already, so the answer begins inside the
reasoning and only `</think>` comes out. As vLLM's Qwen3 parser:
- a `<think>` the model writes itself at the start of its answer is dropped;
- the text before `</think>` is the reasoning, the text after it the content (null when empty);
- no `</think>`: all of it is reasoning (the answer was cut short while thinking), unless the
  request turned thinking off (`chat_template_kwargs: {"enable_thinking": false}`): then the
  template closed the (empty) reasoning in the prompt and all of it is content.
(vLLM drops any text before a `<think>` found anywhere; here only a leading one is, so that a
stream never takes back reasoning it has sent.)

With tool calls read from the answer (`call_start`: the tool parser's `<tool_call>`), a call the
model starts before it closes its reasoning ends the reasoning there: the call and what follows
it are the content (where the tool parser reads the call), and the `</think>` the model may
write after the call is dropped. A call is never reasoning text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlmserve.api.tool_parsers import held_prefix


def thinking_enabled(chat_template_kwargs: dict[str, Any] | None) -> bool:
    """Whether the request leaves the template's thinking on (the Qwen templates' default)."""
    return (chat_template_kwargs or {}).get("enable_thinking", True) is not False


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None
    content: str | None


class ThinkReasoningParser:
    START = "<think>"
    END = "</think>"

    def __init__(self, thinking_enabled: bool = True, call_start: str | None = None) -> None:
        self.thinking_enabled = thinking_enabled
        self.call_start = call_start

    def parse(self, text: str) -> ReasoningSplit:
        if not self.thinking_enabled:
            return ReasoningSplit(None, text)
        lead = text.lstrip()
        if lead.startswith(self.START):
            text = lead[len(self.START) :]
        call = text.find(self.call_start) if self.call_start else -1
        end = text.find(self.END)
        if call >= 0 and (end < 0 or call < end):
            return ReasoningSplit(text[:call], text[call:].replace(self.END, "", 1))
        if end < 0:
            return ReasoningSplit(text, None)
        return ReasoningSplit(text[:end], text[end + len(self.END) :] or None)

    def span(self, text: str) -> tuple[int, int]:
        """Where in `text` the reasoning `parse` gives lies: [start, end) in characters."""
        if not self.thinking_enabled:
            return 0, 0
        lead = len(text) - len(text.lstrip())
        start = lead + len(self.START) if text.startswith(self.START, lead) else 0
        end = text.find(self.END, start)
        call = text.find(self.call_start, start) if self.call_start else -1
        if call >= 0 and (end < 0 or call < end):  # a call begun inside the reasoning ends it
            return start, call
        return start, len(text) if end < 0 else end

    def stream(self) -> ThinkReasoningStream:
        return ThinkReasoningStream(self)


class ThinkReasoningStream:
    """ThinkReasoningParser fed text deltas: each feed gives (reasoning delta, content delta).
    Text that may be the start of `<think>` (at the very start), of `</think>` or of a call
    (while reasoning; after a call began there, of the `</think>` to drop) is held back until
    the next delta says. Only that held text is kept: the work per delta is proportional to the
    delta."""

    def __init__(self, parser: ThinkReasoningParser) -> None:
        self.parser = parser
        self.text = ""  # held back: at most whitespace and a tag's length
        self.lead: list[str] = []  # the answer's leading whitespace, held while a `<think>` may follow
        self.phase = "lead" if parser.thinking_enabled else "content"

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        start, end = self.parser.START, self.parser.END
        reasoning = ""
        if self.phase == "lead":
            lead = self.text.lstrip()
            if not lead and not final:  # whitespace so far: a `<think>` may still follow
                self.lead.append(self.text)
                self.text = ""
                return "", ""
            if lead.startswith(start):
                self.text, self.lead = lead[len(start) :], []
            elif start.startswith(lead) and not final:
                return "", ""
            self.text = "".join(self.lead) + self.text
            self.lead = []
            self.phase = "reasoning"
        if self.phase == "reasoning":
            call_start = self.parser.call_start
            e = self.text.find(end)
            c = self.text.find(call_start) if call_start else -1
            if c >= 0 and (e < 0 or c < e):  # a call inside the reasoning: its end
                reasoning, self.text, self.phase = self.text[:c], self.text[c:], "call"
            elif e < 0:
                held = max(held_prefix(self.text, end), held_prefix(self.text, call_start) if call_start else 0)
                stop = len(self.text) if final else len(self.text) - held
                reasoning, self.text = self.text[:stop], self.text[stop:]
                return reasoning, ""
            else:
                reasoning, self.text, self.phase = self.text[:e], self.text[e + len(end) :], "content"
        if self.phase == "call":  # the `</think>` after the call is dropped
            e = self.text.find(end)
            if e >= 0:
                self.text, self.phase = self.text[:e] + self.text[e + len(end) :], "content"
            else:
                stop = len(self.text) if final else len(self.text) - held_prefix(self.text, end)
                content, self.text = self.text[:stop], self.text[stop:]
                return reasoning, content
        content, self.text = self.text, ""
        return reasoning, content
