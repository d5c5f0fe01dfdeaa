"""What a speculative-decoding verify step costs against a plain decode step, measured.

    python -m vlmserve.bench.verify_cost MODEL [--batch 1 8] [--k 1 2 3 4 5 6 7 8] [--context 512]

A verify step computes, for each of B requests, k + 1 new tokens (its last sampled token and k
drafted ones) after `context` tokens already in the KV cache, with logits at every one of those
rows; a plain decode step computes one token per request, logits at that row. Both run through
the engine's own ModelRunner (prepare -> forward -> compute_logits), on requests the engine
prefilled: their prompts run k + 1 tokens past the context, and before each step the runner's
copy of every request is set back to `context` computed tokens with 1 or k + 1 known past them
(the prompt's next tokens stand in for the drafts; the KV they write is overwritten by the next
step). Timed in rounds alternating plain and verify (plain, k=1, plain, k=2, ...), each entry the
mean of --steps steps; the table gives medians over --rounds rounds and the median of the
per-round ratios (verify over the plain step just before it). The machine is shared: compare the
ratios."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from vlmserve.engine.request_state import CachedRequestState
from vlmserve.engine.step_batch import prepare
from vlmserve.entrypoints.llm import LLM
from vlmserve.ipc.contracts import SchedulerOutput
from vlmserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Row:
    k: int
    batch: int
    plain_ms: float
    verify_ms: float
    ratio: float


def prefilled_requests(llm: LLM, batch: int, context: int, max_k: int, seed: int) -> list[CachedRequestState]:
    """`batch` requests prefilled to context + max_k + 1 prompt tokens, as the runner holds them."""
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(seed)
    ids = [f"verify-{seed}-{i}" for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for request_id in ids:
        prompt = torch.randint(1000, 100000, (context + max_k + 1,), generator=g).tolist()
        engine.add_request(request_id, engine.processor.process(prompt, []), params)
    runner = engine.runner
    while not all(r in runner.requests and len(runner.requests[r].token_ids) > context + max_k + 1 for r in ids):
        engine.step()
    return [runner.requests[r] for r in ids]


@torch.inference_mode()
def step_hidden(
    llm: LLM, states: list[CachedRequestState], prompts: dict[str, list[int]], context: int, n: int
) -> torch.Tensor:
    """One step of n new tokens per request (its prompt's next n) after `context` cached ones,
    through the runner's forward: the hidden states of every row [len(states) * n, hidden],
    request by request."""
    engine = llm.llm_engine
    runner, model = engine.runner, engine.model
    for state in states:
        state.num_computed_tokens = context
        state.token_ids = prompts[state.request_id][: context + n]
    step = SchedulerOutput(num_scheduled_tokens={s.request_id: n for s in states})
    batch = prepare(step, runner.requests, runner.encoder_cache, runner.block_size, model.decode_positions, False)
    return runner.forward(batch, step)


def step_logits(
    llm: LLM, states: list[CachedRequestState], prompts: dict[str, list[int]], context: int, n: int
) -> torch.Tensor:
    """step_hidden's logits at every row (what verifying every drafted row samples from)."""
    with torch.inference_mode():
        return llm.llm_engine.model.compute_logits(step_hidden(llm, states, prompts, context, n))


def measure(llm: LLM, batches: list[int], ks: list[int], context: int, rounds: int, steps: int) -> list[Row]:
    rows: list[Row] = []
    for b in batches:
        states = prefilled_requests(llm, b, context, max(ks), seed=b)
        prompts = {s.request_id: list(s.token_ids) for s in states}
        saved = {s.request_id: s.num_computed_tokens for s in states}

        def timed(n: int, states: list[CachedRequestState] = states, prompts: dict[str, list[int]] = prompts) -> float:
            start = time.perf_counter()
            for _ in range(steps):
                step_logits(llm, states, prompts, context, n)
            return (time.perf_counter() - start) / steps * 1e3

        for k in ks:  # warm-up: first-call costs of each shape
            timed(1)
            timed(k + 1)
        plain: dict[int, list[float]] = {k: [] for k in ks}
        verify: dict[int, list[float]] = {k: [] for k in ks}
        for _ in range(rounds):
            for k in ks:
                plain[k].append(timed(1))
                verify[k].append(timed(k + 1))
        for k in ks:
            ratios = [v / p for v, p in zip(verify[k], plain[k], strict=True)]
            rows.append(Row(k, b, statistics.median(plain[k]), statistics.median(verify[k]), statistics.median(ratios)))
        for state in states:  # as the engine left them, then gone
            state.token_ids = prompts[state.request_id]
            state.num_computed_tokens = saved[state.request_id]
            llm.llm_engine.abort_request(state.request_id)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vlmserve.bench.verify_cost", description=__doc__)
    parser.add_argument("model", help="checkpoint directory")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="requests per step")
    parser.add_argument("--k", type=int, nargs="+", default=list(range(1, 9)), help="drafted tokens per request")
    parser.add_argument("--context", type=int, default=512, help="tokens in the KV cache before the step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed entry")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    if min(args.k) < 1 or min(args.batch) < 1:
        parser.error("--k and --batch take positive numbers")
    max_len = args.context + max(args.k) + 80
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device="cpu",
        max_model_len=max_len,
        max_num_seqs=max(args.batch),
        enable_prefix_caching=False,
    )
    rows = measure(llm, args.batch, args.k, args.context, args.rounds, args.steps)
    print(f"{args.model}, {args.dtype}, {args.context} tokens of context, {torch.get_num_threads()} threads")
    print("| k | batch | plain ms | verify ms | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r.k} | {r.batch} | {r.plain_ms:.2f} | {r.verify_ms:.2f} | {r.ratio:.2f} |")


if __name__ == "__main__":
    main()
