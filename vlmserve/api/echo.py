"""What `echo` and `prompt_logprobs` add to a response, as vLLM writes them.

- Completions `echo`: each choice's text starts with the prompt (its text as given, or its token
  ids decoded); with `logprobs`, the prompt's tokens come first in the legacy lists, the first one
  with a null logprob and null alternatives (nothing precedes it), and `text_offset` runs on
  through the prompt into the answer.
- Chat `echo`: the last message's content comes first in each answer, when that message's role
  is the answer's role (the assistant's with add_generation_prompt, else the last message's own
  role, which then always matches): vLLM's rule for prefilling an assistant turn.
- `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
  decoded_token}}, the ids as JSON object keys."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import CompletionOutput, Logprob, RequestOutput
from vlmserve.tokenizer import AnyTokenizer


def shown_token(token_id: int, text: str | None, as_token_ids: bool) -> str | None:
    """A logprob token as a response writes it: its text, or vLLM's "token:<id>"."""
    return f"token:{token_id}" if as_token_ids else text


def prompt_text(prompt: ProcessedPrompt, tokenizer: AnyTokenizer) -> str:
    """The prompt as completions' echo shows it: its text, or its token ids decoded."""
    if prompt.prompt is not None:
        return prompt.prompt
    return tokenizer.decode(prompt.prompt_token_ids, skip_special_tokens=False)


def legacy_logprobs(
    token_ids: list[int],
    entries: list[dict[int, Logprob] | None],
    text_offset: int,
    decode: Callable[[int], str],
    as_token_ids: bool = False,
) -> dict[str, Any]:
    """Legacy completions' parallel lists over `token_ids`; an entry of None (the prompt's first
    token) has a null logprob and null alternatives, its text from `decode`. Each token starts
    the previous one's length further (vLLM counts the token as shown)."""
    tokens: list[str | None] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str | None, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            token = shown_token(token_id, decode(token_id), as_token_ids)
            token_logprobs.append(None)
            top.append(None)
        else:
            token = shown_token(token_id, entry[token_id].decoded_token, as_token_ids)
            token_logprobs.append(entry[token_id].logprob)
            top.append({shown_token(tid, lp.decoded_token, as_token_ids): lp.logprob for tid, lp in entry.items()})
        offsets.append(offset)
        offset += len(token or "")
        tokens.append(token)
    return {"text_offset": offsets, "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top}


def echoed_logprobs(
    final: RequestOutput, choice: CompletionOutput, tokenizer: AnyTokenizer, as_token_ids: bool
) -> dict[str, Any] | None:
    """A choice's legacy logprobs with the prompt's tokens first (None: logprobs not asked for)."""
    if choice.logprobs is None:
        return None
    prompt_entries = final.prompt_logprobs
    assert prompt_entries is not None, "echo with logprobs asks for the prompt's logprobs"
    return legacy_logprobs(
        [*final.prompt_token_ids, *choice.token_ids],
        [*prompt_entries, *choice.logprobs],
        0,
        lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False),
        as_token_ids,
    )


def prompt_logprobs_json(prompt_logprobs: list[dict[int, Logprob] | None] | None) -> list[Any] | None:
    if prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]


def chat_echo(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """The text chat's echo puts before each answer (empty: nothing to echo)."""
    last = messages[-1]
    role = "assistant" if add_generation_prompt else last.get("role")
    if last.get("role") != role:
        return ""
    content = last.get("content")
    if isinstance(content, list):  # the text parts, one a line (vLLM's join)
        return "\n".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return content if isinstance(content, str) else ""


def with_echo(message: dict[str, Any], echo: str) -> dict[str, Any]:
    """The choice's message with the echoed text before its content (after the answer was parsed
    for reasoning and tool calls, as vLLM prepends it)."""
    if not echo:
        return message
    return message | {"content": echo + (message.get("content") or "")}
