"""Speculative decoding end to end: the same requests through the offline engine without and with
a speculative_config, in alternating rounds on one machine, each request sampled with the
checkpoint's own defaults (generation_config.json; `--sampling '{"temperature": 1.0}'` overrides fields), and per
configuration the generated tokens per second, the acceptance, and whether the outputs agree.

    python -m vlmserve.bench.speculative DIR --speculative-config '{"method": "ngram", ...}'
        [--requests 1] [--max-tokens 128] [--rounds 3] [--sampling JSON]

Outputs agree token for token where the requests' sampling is deterministic (greedy, or top_k 1
as Qwen2-VL's published defaults); seeded sampled requests (each request gets a seed) are
reproducible run to run but their tokens depend on the drafts, so they are not compared then."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from typing import Any

PROMPTS = [
    "Tell me a story about a lighthouse.",
    "List the primes below fifty.",
    "What is the capital of France?",
    "Describe the sea in a few words.",
    "Write a haiku about autumn leaves.",
    "Explain how a bicycle works.",
    "Name three colours of the rainbow.",
    "Why is the sky blue?",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlmserve.bench.speculative", description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--speculative-config", required=True, type=json.loads)
    p.add_argument("--requests", type=int, default=1, help="requests decoded together")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sampling", type=json.loads, default={}, help="SamplingParams fields over the checkpoint's")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)

    from vlmserve import LLM

    common: dict[str, Any] = {"dtype": args.dtype, "max_model_len": 4096, "max_num_seqs": max(8, args.requests)}
    engines = {
        "off": LLM(args.model, **common),
        "on": LLM(args.model, **common, speculative_config=args.speculative_config),
    }
    params = engines["off"].get_default_sampling_params()
    params = replace(params, **args.sampling)
    params = replace(params, max_tokens=args.max_tokens, ignore_eos=True)
    deterministic = params.takes_argmax
    prompts = [PROMPTS[i % len(PROMPTS)] + (f" ({i})" if i >= len(PROMPTS) else "") for i in range(args.requests)]
    per_request = [params if deterministic else replace(params, seed=1000 + i) for i in range(args.requests)]
    source = "the checkpoint's" + (f", with {args.sampling}" if args.sampling else "")
    print(
        f"sampling: temperature {params.temperature}, top_k {params.top_k}, top_p {params.top_p}, "
        f"repetition_penalty {params.repetition_penalty} ({source})"
    )
    for engine in engines.values():  # warm up: the kernels' first calls, the allocator
        engine.generate(prompts[:1], replace(params, max_tokens=4))
    rates: dict[str, list[float]] = {"off": [], "on": []}
    outputs: dict[str, list[list[int]]] = {}
    core = engines["on"].llm_engine.core
    before = core.spec_stats.copy()
    for _ in range(args.rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            done = engine.generate(prompts, per_request)
            elapsed = time.perf_counter() - start
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in done) / elapsed)
            outputs[name] = [o.outputs[0].token_ids for o in done]
    spec = core.spec_stats.since(before)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"{args.requests} requests x {args.max_tokens} tokens, {args.rounds} rounds, median:")
    print(f"  speculation off  {off:8.1f} tokens/s  (rounds: {', '.join(f'{r:.1f}' for r in rates['off'])})")
    print(f"  speculation on   {on:8.1f} tokens/s  (rounds: {', '.join(f'{r:.1f}' for r in rates['on'])})")
    print(f"  ratio            {on / off:8.2f}x")
    print(
        f"  drafts: {spec.num_drafts} verifications, {spec.num_draft_tokens} tokens drafted, "
        f"{spec.num_accepted_tokens} accepted ({100 * spec.acceptance_rate:.1f}%), "
        f"mean acceptance length {spec.mean_acceptance_length:.2f}"
    )
    if deterministic:
        same = outputs["off"] == outputs["on"]
        print(f"  outputs: {'identical' if same else 'DIFFERENT'} token for token")
        return 0 if same else 1
    print("  outputs: sampled (seeded per request): not compared")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
