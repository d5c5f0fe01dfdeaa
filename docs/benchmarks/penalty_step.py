"""Per-step cost of the penalties at batch 32, vocab 151936: recomputed from token ids (what the
sampler does) against per-request counts kept up to date (the alternative)."""

import time

import torch

from vlmserve.engine.sampler import Sampler, TokenHistory
from vlmserve.sampling_params import SamplingParams

torch.manual_seed(0)
B, V, PROMPT, OUT = 32, 151936, 1000, 256
logits = torch.randn(B, V)
histories = [TokenHistory(torch.randint(0, V, (PROMPT + OUT,)).tolist(), PROMPT) for _ in range(B)]
plain = [SamplingParams(temperature=0)] * B
rep = [SamplingParams(temperature=0, repetition_penalty=1.05)] * B
allp = [SamplingParams(temperature=0, repetition_penalty=1.05, presence_penalty=0.5, frequency_penalty=0.5)] * B


def best(f, n=50):
    f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3, sorted(times)[n // 2] * 1e3


# The alternative: per-request state kept across steps ([B, V] seen mask and output counts, one
# scatter per step for the new tokens), leaving only the arithmetic per step.
seen = torch.zeros(B, V, dtype=torch.bool)
counts = torch.zeros(B, V)
new = torch.randint(0, V, (B,))
rows = torch.arange(B)
p = torch.full((B, 1), 1.05)


def incremental():
    seen[rows, new] = True
    counts[rows, new] += 1
    x = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    return x - 0.5 * counts - 0.5 * (counts > 0).float()


print(f"no penalty (skipped):         {best(lambda: Sampler()(logits, plain, [None] * B, histories))}")
print(f"repetition, recomputed:       {best(lambda: Sampler.process(logits, rep, histories))}")
print(f"all three, recomputed:        {best(lambda: Sampler.process(logits, allp, histories))}")
print(f"all three, incremental state: {best(incremental)}")
print(f"argmax alone:                 {best(lambda: logits.argmax(-1))}")
