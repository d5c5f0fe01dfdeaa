"""Requests that share a system prompt and tool list: time to first token with prefix caching on
and off, on a model with recurrent state (Qwen3.5) or any other.

    python -m vlmserve.bench.shared_preamble MODEL [--requests 8] [--rules 60]

Runs `--requests` chats one after another through the offline API (float32), each with the same
system prompt (`--rules` shop rules, about 12 tokens each) and four tools, and its own question,
one output token each (the time of a request is its time to first token), first with prefix
caching on, then off. Prints each request's time and cached prompt tokens, and whether the
greedy tokens of both runs agree. The machine is shared: compare within one run."""

from __future__ import annotations

import argparse
import statistics
import time

from vlmserve.entrypoints.llm import LLM
from vlmserve.sampling_params import SamplingParams


def shop_system_prompt(rules: int = 60) -> str:
    """A shop assistant's system prompt of `rules` rules (about 12 tokens each)."""
    return "You are a careful assistant for a hardware shop. " + " ".join(
        f"Rule {i}: when asked about item {i}, say its shelf and price." for i in range(rules)
    )


def shop_tools() -> list[dict]:
    """Four catalogue tools (about 350 tokens as Qwen's templates render them)."""
    return [
        {
            "type": "function",
            "function": {
                "name": f"lookup_{kind}",
                "description": f"Look up an item's {kind} in the catalogue.",
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                    "required": ["query"],
                },
            },
        }
        for kind in ("price", "shelf", "stock", "supplier")
    ]


def run(model: str, requests: int, rules: int) -> None:
    system = shop_system_prompt(rules)
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Where is item {i}, what does it cost?"}]
        for i in range(requests)
    ]
    greedy = SamplingParams(max_tokens=1, temperature=0)
    tokens: dict[bool, list[list[int]]] = {}
    for caching in (True, False):
        llm = LLM(model, dtype="float32", max_model_len=8192, enable_prefix_caching=caching)
        llm.chat(chats[0][1:], greedy)  # warm up (no shared prefix with the chats)
        times, cached, tokens[caching] = [], [], []
        for chat in chats:
            start = time.perf_counter()
            (out,) = llm.chat(chat, greedy, chat_template_kwargs={"tools": shop_tools()})
            times.append(time.perf_counter() - start)
            cached.append(out.num_cached_tokens)
            tokens[caching].append(out.outputs[0].token_ids)
        label = "prefix caching on " if caching else "prefix caching off"
        print(f"{label}: prompt {len(out.prompt_token_ids)} tokens; cached {cached}")
        print(f"  time to first token (s): {' '.join(f'{t:.3f}' for t in times)}")
        print(f"  first {times[0]:.3f} s, median of the rest {statistics.median(times[1:]):.3f} s")
        del llm
    print(f"greedy tokens equal: {tokens[True] == tokens[False]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vlmserve.bench.shared_preamble", description=__doc__)
    parser.add_argument("model", help="checkpoint directory (vlmserve make-tiny --arch qwen3_5 [--preset bench] DIR)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rules", type=int, default=60, help="rules in the system prompt (about 12 tokens each)")
    args = parser.parse_args(argv)
    run(args.model, args.requests, args.rules)


if __name__ == "__main__":
    main()
