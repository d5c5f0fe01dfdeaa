"""The per-step cost of structured outputs' masks: `python -m vlmserve.bench.grammar_mask MODEL_DIR
[--batch 32] [--steps 50]`. Every row of a batch follows its own JSON schema (the matchers walk
random grammar-allowed tokens, so each step's masks are mid-answer, not at the start); prints the
milliseconds per step of filling the bitmask, applying it, and the sampler with and without it."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from vlmserve.bench.sampling import request_schema
from vlmserve.engine.sampler import GrammarMask, Sampler
from vlmserve.engine.structured_output import GrammarCompiler, GrammarState, TokenBitmask, apply_token_bitmask
from vlmserve.registry import family_of, load_model_config
from vlmserve.sampling_params import SamplingParams, StructuredOutputsParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vlmserve.bench.grammar_mask")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = load_model_config(args.model_dir / "config.json")
    tokenizer = family_of(config).load_tokenizer(args.model_dir)
    vocab = config.text.vocab_size
    eos = [tokenizer.eos_token_id or 0]
    grammars = GrammarCompiler(lambda: [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)], vocab, eos)
    start = time.perf_counter()
    specs = [StructuredOutputsParams(json=request_schema(i)) for i in range(args.batch)]
    compiled = [grammars.compile(spec) for spec in specs]
    print(f"vocabulary + compile {args.batch} schemas: {time.perf_counter() - start:.2f} s")
    states = [GrammarState.start(grammar) for grammar in compiled]
    bitmask = TokenBitmask(vocab)
    sampler = Sampler()
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(args.batch)]
    generator = torch.Generator().manual_seed(0)
    fill = apply = with_mask = without = 0.0
    for _ in range(args.steps):
        logits = torch.randn(args.batch, vocab, generator=generator)
        t0 = time.perf_counter()
        mask, rows = bitmask.fill(states)
        t1 = time.perf_counter()
        apply_token_bitmask(logits.clone(), mask, rows)
        t2 = time.perf_counter()
        tokens = sampler(logits, params, [None] * args.batch, None, GrammarMask(mask, rows))
        t3 = time.perf_counter()
        sampler(logits, params, [None] * args.batch)
        t4 = time.perf_counter()
        fill, apply, with_mask, without = fill + t1 - t0, apply + t2 - t1, with_mask + t3 - t2, without + t4 - t3
        for i, (state, token) in enumerate(zip(states, tokens, strict=True)):
            state.accept(token)
            if state.terminated:
                states[i] = GrammarState.start(compiled[i])
    n = args.steps / 1000
    result = {
        "batch": args.batch,
        "vocab": vocab,
        "fill_ms": round(fill / n, 2),
        "apply_ms": round(apply / n, 2),
        "sampler_with_mask_ms": round(with_mask / n, 2),
        "sampler_without_mask_ms": round(without / n, 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
