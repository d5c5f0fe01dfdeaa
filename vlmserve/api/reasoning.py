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
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmserve.api.tool_parsers import held_prefix


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None
    content: str | None


class ThinkReasoningParser:
    START = "<think>"
    END = "</think>"

    def __init__(self, thinking_enabled: bool = True) -> None:
        self.thinking_enabled = thinking_enabled

    def parse(self, text: str) -> ReasoningSplit:
        if not self.thinking_enabled:
            return ReasoningSplit(None, text)
        lead = text.lstrip()
        if lead.startswith(self.START):
            text = lead[len(self.START) :]
        reasoning, end, content = text.partition(self.END)
        if not end:
            return ReasoningSplit(text, None)
        return ReasoningSplit(reasoning, content or None)

    def span(self, text: str) -> tuple[int, int]:
        """Where in `text` the reasoning `parse` gives lies: [start, end) in characters."""
        if not self.thinking_enabled:
            return 0, 0
        lead = len(text) - len(text.lstrip())
        start = lead + len(self.START) if text.startswith(self.START, lead) else 0
        end = text.find(self.END, start)
        return start, len(text) if end < 0 else end

    def stream(self) -> ThinkReasoningStream:
        return ThinkReasoningStream(self)


class ThinkReasoningStream:
    """ThinkReasoningParser fed text deltas: each feed gives (reasoning delta, content delta).
    Text that may be the start of `<think>` (at the very start) or of `</think>` is held back
    until the next delta says. Only that held text is kept: the work per delta is proportional
    to the delta."""

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
            e = self.text.find(end)
            if e < 0:
                stop = len(self.text) if final else len(self.text) - held_prefix(self.text, end)
                reasoning, self.text = self.text[:stop], self.text[stop:]
                return reasoning, ""
            reasoning, self.text, self.phase = self.text[:e], self.text[e + len(end) :], "content"
        content, self.text = self.text, ""
        return reasoning, content
