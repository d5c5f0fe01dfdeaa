"""The pieces of an OpenAI response both endpoints build alike: token usage, the `vlmserve`
extension field, the two logprob formats (chat's per-token entries with their top alternatives,
legacy completions' parallel lists) and server-sent-event framing. Plain functions of finished
data: no engine, no request state."""

from __future__ import annotations

import json
from typing import Any

from vlmserve.api.echo import legacy_logprobs
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import CompletionOutput, Logprob, RequestOutput
from vlmserve.tokenizer import AnyTokenizer

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def response_id(prefix: str, given: str | None, engine_id: str) -> str:
    """The id a response shows: built on the request's `request_id` when it gives one (vLLM's
    field), else the engine request's own id (which stays unique either way)."""
    return engine_id if given is None else f"{prefix}-{given}"


def usage(prompt: ProcessedPrompt, output: RequestOutput, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """`reasoning_tokens`: the completion's tokens that were reasoning, where a reasoning parser
    read it (OpenAI's completion_tokens_details, as vLLM gives it)."""
    completion = sum(len(o.token_ids) for o in output.outputs)
    details = {} if reasoning_tokens is None else {"completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}
    return {
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": completion,
        "total_tokens": len(output.prompt_token_ids) + completion,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
        **details,
        "multimodal_tokens": multimodal_tokens(prompt),
    }


def multimodal_tokens(prompt: ProcessedPrompt) -> list[dict[str, Any]]:
    """The usage's extension: each image's placeholder tokens and the size the model saw it at."""
    return [
        {
            "modality": item.modality,
            "tokens": item.length,
            "original_size": list(item.original_size),
            "resized_size": list(item.resized_size),
        }
        for item in prompt.mm_items
    ]


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The usage so far, as vLLM's continuous_usage_stats puts it on every streamed chunk."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def extension(
    prompts: list[ProcessedPrompt],
    grounding_convention: str | None,
    with_prompt_index: bool = False,
    finals: list[RequestOutput] | None = None,
) -> dict[str, Any]:
    """The `vlmserve` extension field of a response (or of a stream's first chunk): each image's
    size as sent and as the model saw it, and the convention of the model's grounding boxes,
    so a client can map boxes to its own pixels (vlmserve.grounding does it in Python). With the
    finished outputs, where speculative decoding drafted for them: per choice, the drafted tokens
    verified, those accepted, and the rate."""
    items = []
    for i, prompt in enumerate(prompts):
        for item in prompt.mm_items:
            entry = {
                "modality": item.modality,
                "original_size": list(item.original_size),
                "resized_size": list(item.resized_size),
            }
            items.append({"prompt_index": i} | entry if with_prompt_index else entry)
    out: dict[str, Any] = {"grounding_convention": grounding_convention, "mm_items": items}
    choices = [c for final in finals or () for c in final.outputs]
    if any(c.num_draft_tokens for c in choices):
        out["speculative"] = [
            {
                "num_draft_tokens": c.num_draft_tokens,
                "num_accepted_tokens": c.num_accepted_tokens,
                "acceptance_rate": c.num_accepted_tokens / c.num_draft_tokens if c.num_draft_tokens else 0.0,
            }
            for c in choices
        ]
    return out


def chat_logprobs(
    choice: CompletionOutput, start: int, k: int, tokenizer: AnyTokenizer, as_token_ids: bool = False
) -> dict[str, Any] | None:
    """OpenAI's chat logprobs for tokens [start:]: each token with its `k` most likely
    alternatives (the entries ranked 1..k; the sampled token is among them when it ranks; -1:
    all). as_token_ids: tokens written "token:<id>", their bytes those of that text (vLLM's)."""
    if choice.logprobs is None:
        return None

    def token(token_id: int, lp: Logprob) -> dict[str, Any]:
        if as_token_ids:
            shown = f"token:{token_id}"
            return {"token": shown, "logprob": lp.logprob, "bytes": list(shown.encode())}
        return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(tokenizer.token_bytes(token_id))}

    content = []
    for token_id, entry in zip(choice.token_ids[start:], choice.logprobs[start:], strict=True):
        ranked = sorted(((lp.rank or 0, tid, lp) for tid, lp in entry.items() if k == -1 or (lp.rank or 0) <= k))
        content.append(token(token_id, entry[token_id]) | {"top_logprobs": [token(tid, lp) for _, tid, lp in ranked]})
    return {"content": content}


def completion_logprobs(
    choice: CompletionOutput, start: int = 0, text_offset: int = 0, as_token_ids: bool = False
) -> dict[str, Any] | None:
    """Legacy completions' logprobs for tokens [start:]: the sampled tokens, their logprobs, each
    position's alternatives as a {token: logprob} map, and where each token starts in the choice's
    text (`text_offset`: the first at `text_offset`, each next one the previous token's length
    further, as vLLM counts)."""
    if choice.logprobs is None:
        return None
    entries: list[dict[int, Logprob] | None] = list(choice.logprobs[start:])
    return legacy_logprobs(choice.token_ids[start:], entries, text_offset, str, as_token_ids)
