"""The sampler alone, as a step calls it: `python -m vlmserve.bench.sampler [--batch 1 8 32 64 256]`.

bf16 logits [batch, 151936] (what the model hands the sampler on the CPU), shaped like a trained
model's next-token distribution (a Zipf-like fall over ranks, each row its own order; `--logits
flat` for random-weight checkpoints' near-uniform ones), each row with 1,000 prompt and 256
output tokens of history. One line per batch size and parameter set: milliseconds per call
(median and best of --rounds) and the ratio of the median to greedy's at the same batch size.
Parameter sets: greedy, temperature 1.0 over the whole vocabulary, the published checkpoints'
generation_config.json (Qwen2-VL, Qwen2.5-VL with its repetition_penalty, Qwen3-VL / Qwen3.5,
and Qwen3-VL with the presence_penalty of its model card), top_p 0.9 alone, min_p, and with
--json-schema each row following its own JSON schema (the grammar mask filled and applied)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import TYPE_CHECKING

import torch

from vlmserve.arg_types import positive_int
from vlmserve.bench.sampling import request_schema
from vlmserve.engine.sampler import GrammarMask, Sampler, TokenHistory
from vlmserve.engine.structured_output import GrammarCompiler, GrammarState, TokenBitmask
from vlmserve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

VOCAB = 151936
PROMPT, OUTPUT = 1000, 256

QWEN2_VL = {"temperature": 0.01, "top_k": 1, "top_p": 0.001}
QWEN3_VL = {"temperature": 0.7, "top_k": 20, "top_p": 0.8}
PARAMETER_SETS: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "temperature 1.0 (whole vocabulary)": {"temperature": 1.0},
    "Qwen2-VL (0.01, top_k 1, top_p 0.001)": QWEN2_VL,
    "Qwen2.5-VL (Qwen2-VL's + repetition_penalty 1.05)": {**QWEN2_VL, "repetition_penalty": 1.05},
    "Qwen3-VL / Qwen3.5 (0.7, top_k 20, top_p 0.8)": QWEN3_VL,
    "Qwen3-VL + presence_penalty 1.5 (model card)": {**QWEN3_VL, "presence_penalty": 1.5},
    "temperature 0.8, top_p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "temperature 1.0, min_p 0.05": {"temperature": 1.0, "min_p": 0.05},
}


def make_logits(batch: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """[batch, VOCAB] bf16. peaked: logit = -1.1 ln(rank) plus noise (a Zipf fall, the shape of a
    trained model's next-token distribution), ranks shuffled per row; flat: N(0, 1)."""
    if kind == "flat":
        return torch.randn(batch, VOCAB, generator=generator).bfloat16()
    ranks = torch.arange(1, VOCAB + 1, dtype=torch.float32)
    rows = []
    for _ in range(batch):
        values = 8.0 - 1.1 * ranks.log() + 0.3 * torch.randn(VOCAB, generator=generator)
        rows.append(values[torch.randperm(VOCAB, generator=generator)])
    return torch.stack(rows).bfloat16()


def _time(call: object, rounds: int) -> tuple[float, float]:
    assert callable(call)
    call()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, min(times) * 1e3


def _grammar_rows(batch: int) -> tuple[list[GrammarState], list[xgrammar.CompiledGrammar]]:
    from vlmserve.registry import family_of, load_model_config
    from vlmserve.tools.tiny_checkpoint import tiny_checkpoint_dir

    model_dir = tiny_checkpoint_dir()  # for the real Qwen vocabulary's bytes
    tokenizer = family_of(load_model_config(model_dir / "config.json")).load_tokenizer(model_dir)
    grammars = GrammarCompiler(
        lambda: [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)], VOCAB, [tokenizer.eos_token_id or 0]
    )
    compiled = [grammars.compile(StructuredOutputsParams(json=request_schema(i))) for i in range(batch)]
    return [GrammarState.start(grammar) for grammar in compiled], compiled


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vlmserve.bench.sampler", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=positive_int, nargs="+", default=[1, 8, 32, 64, 256])
    parser.add_argument("--rounds", type=positive_int, default=15)
    parser.add_argument("--logits", choices=["peaked", "flat"], default="peaked")
    parser.add_argument("--json-schema", action="store_true", help="also every row under its own JSON schema")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    print(f"vocabulary {VOCAB}, {args.logits} logits, history {PROMPT} + {OUTPUT} tokens, {args.rounds} rounds")
    for batch in args.batch:
        _run_batch(batch, args, generator)


def _run_batch(batch: int, args: argparse.Namespace, generator: torch.Generator) -> None:
    sampler = Sampler()
    logits = make_logits(batch, args.logits, generator)
    histories = [
        TokenHistory(torch.randint(0, VOCAB, (PROMPT + OUTPUT,), generator=generator).tolist(), PROMPT)
        for _ in range(batch)
    ]
    greedy_ms = 0.0
    for name, values in PARAMETER_SETS.items():
        params = [SamplingParams(**values)] * batch
        median, best = _time(lambda: sampler(logits, params, [None] * batch, histories), args.rounds)  # noqa: B023
        greedy_ms = greedy_ms or median
        _report(args.json, batch, name, median, best, greedy_ms)
    if not args.json_schema:
        return
    states, compiled = _grammar_rows(batch)
    bitmask = TokenBitmask(VOCAB)
    for name in ("greedy", "Qwen3-VL / Qwen3.5 (0.7, top_k 20, top_p 0.8)"):
        params = [SamplingParams(**PARAMETER_SETS[name])] * batch

        def step() -> None:
            # The mask filled (as the runner does each step) and applied by the sampler; the
            # sampled tokens advance the matchers, so the masks are mid-answer.
            grammar = GrammarMask(*bitmask.fill(states))
            tokens = sampler(logits, params, [None] * batch, histories, grammar)  # noqa: B023
            for i, token in enumerate(tokens):
                states[i].accept(token)
                if states[i].terminated:
                    states[i] = GrammarState.start(compiled[i])

        median, best = _time(step, args.rounds)
        _report(args.json, batch, f"{name} + json_schema", median, best, greedy_ms)


def _report(as_json: bool, batch: int, name: str, median: float, best: float, greedy_ms: float) -> None:
    ratio = median / greedy_ms
    if as_json:
        print(json.dumps({"batch": batch, "params": name, "median_ms": median, "best_ms": best, "x_greedy": ratio}))
    else:
        print(f"batch {batch:4d}  {name:52s} {median:8.2f} ms (best {best:7.2f})  {ratio:6.2f}x greedy")


if __name__ == "__main__":
    main()
