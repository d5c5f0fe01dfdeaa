"""Per-request timings and the numbers a serving benchmark reports."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


def median_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of `repeat` calls, after one untimed warm-up call."""
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@dataclass
class RequestTiming:
    index: int
    prompt_tokens: int
    output_tokens: int  # the request's own tokens (a static batch may run past them)
    submitted: float
    first_token: float
    finished: float
    token_ids: list[int] = field(default_factory=list)  # the request's own generated tokens

    @property
    def ttft(self) -> float:
        return self.first_token - self.submitted

    @property
    def tpot(self) -> float | None:
        return (self.finished - self.first_token) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class RunResult:
    engine: str  # "vlmserve" or "transformers"
    setting: dict[str, object]  # concurrency / batch size, image size, ...
    wall_s: float
    timings: list[RequestTiming] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.timings)

    @property
    def useful_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def ttft_mean(self) -> float:
        return statistics.fmean(t.ttft for t in self.timings)

    @property
    def ttft_p50(self) -> float:
        return statistics.median(t.ttft for t in self.timings)

    @property
    def tpot_mean(self) -> float:
        values = [t.tpot for t in self.timings if t.tpot is not None]
        return statistics.fmean(values) if values else float("nan")

    def summary(self) -> dict[str, object]:
        return {
            "engine": self.engine,
            **self.setting,
            "requests": len(self.timings),
            "wall_s": round(self.wall_s, 3),
            "output_tokens": self.output_tokens,
            "useful_tokens_per_s": round(self.useful_tokens_per_s, 2),
            "ttft_mean_s": round(self.ttft_mean, 4),
            "ttft_p50_s": round(self.ttft_p50, 4),
            "tpot_mean_s": round(self.tpot_mean, 5),
        }

    def to_json(self) -> dict[str, object]:
        return {"summary": self.summary(), "requests": [asdict(t) for t in self.timings]}


def greedy_agreement(ours: RunResult, theirs: RunResult) -> dict[str, object]:
    """How far two greedy runs of the same requests agree: how many requests got identical
    tokens, and per request the tokens before the first difference. In float32 the engines
    should agree throughout; in bfloat16 rounding may make them part after a while."""
    theirs_by_index = {t.index: t.token_ids for t in theirs.timings}
    prefixes, identical = [], 0
    for t in ours.timings:
        other = theirs_by_index[t.index]
        prefix = 0
        while prefix < min(len(t.token_ids), len(other)) and t.token_ids[prefix] == other[prefix]:
            prefix += 1
        prefixes.append(prefix)
        identical += t.token_ids == other
    return {"requests": len(prefixes), "identical": identical, "tokens_before_first_difference": prefixes}


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Prints rows (dicts) as right-aligned columns under a blank line and the title."""
    print(f"\n{title}")
    widths = [max(len(c), *(len(f"{r.get(c, '')}") for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(f"{r.get(c, '')}".rjust(w) for c, w in zip(columns, widths, strict=True)))
