"""The serving engine's periodic throughput line, as vLLM logs it: prompt and generation tokens
per second over the last interval, requests running and waiting, KV cache usage and the prefix
cache's hit rate (and with speculative decoding a second line: the drafts verified, accepted, and
the acceptance rate per draft position). Logged while there is work, and once more when the
engine falls idle."""

from __future__ import annotations

import logging
import time

from vlmserve.engine.core import EngineCore
from vlmserve.engine.speculative import SpeculativeStats


class StatLogger:
    def __init__(self, core: EngineCore, interval_s: float, logger: logging.Logger) -> None:
        self.core = core
        self.interval_s = interval_s
        self.logger = logger
        self.last_time = time.monotonic()
        self.last_prompt_tokens = core.num_prompt_tokens
        self.last_generation_tokens = core.num_generation_tokens
        self.last_spec = _copy(core.spec_stats)
        self.was_busy = False

    def maybe_log(self) -> None:
        now = time.monotonic()
        elapsed = now - self.last_time
        if self.interval_s <= 0 or elapsed < self.interval_s:
            return
        core, scheduler = self.core, self.core.scheduler
        prompt = core.num_prompt_tokens - self.last_prompt_tokens
        generation = core.num_generation_tokens - self.last_generation_tokens
        running, waiting = len(scheduler.running), len(scheduler.waiting)
        busy = bool(prompt or generation or running or waiting)
        if busy or self.was_busy:
            queries = core.kv.prefix_queries
            hit_rate = core.kv.prefix_hits / queries if queries else 0.0
            self.logger.info(
                "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, running: %d reqs, "
                "waiting: %d reqs, KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
                prompt / elapsed,
                generation / elapsed,
                running,
                waiting,
                100 * core.kv.usage,
                100 * hit_rate,
            )
            if core.speculative is not None:
                self._log_speculation(elapsed)
        self.was_busy = busy
        self.last_time = now
        self.last_prompt_tokens = core.num_prompt_tokens
        self.last_generation_tokens = core.num_generation_tokens

    def _log_speculation(self, elapsed: float) -> None:
        now, last = self.core.spec_stats, self.last_spec
        drafts = now.num_drafts - last.num_drafts
        drafted = now.num_draft_tokens - last.num_draft_tokens
        accepted = now.num_accepted_tokens - last.num_accepted_tokens
        assert now.accepted_per_position is not None and last.accepted_per_position is not None
        per_position = [a - b for a, b in zip(now.accepted_per_position, last.accepted_per_position, strict=True)]
        self.logger.info(
            "speculative decoding: mean acceptance length: %.2f, accepted throughput: %.1f tokens/s, drafted "
            "throughput: %.1f tokens/s, accepted: %d tokens, drafted: %d tokens, per-position acceptance rate: %s, "
            "draft acceptance rate: %.1f%%",
            1 + accepted / drafts if drafts else 0.0,
            accepted / elapsed,
            drafted / elapsed,
            accepted,
            drafted,
            ", ".join(f"{n / drafts:.3f}" if drafts else "0.000" for n in per_position),
            100 * accepted / drafted if drafted else 0.0,
        )
        self.last_spec = _copy(now)


def _copy(stats: SpeculativeStats) -> SpeculativeStats:
    return SpeculativeStats(
        stats.num_speculative_tokens,
        stats.num_drafts,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
        list(stats.accepted_per_position or ()),
    )
