"""The serving engine's periodic throughput line, as vLLM logs it: prompt and generation tokens
per second over the last interval, requests running and waiting, KV cache usage and the prefix
cache's hit rate (and with speculative decoding a second line: the drafts verified, accepted, and
the acceptance rate per draft position). Logged while there is work, and once more when the
engine falls idle."""

from __future__ import annotations

import logging
import time

from vlmserve.engine.core import EngineCore


class StatLogger:
    def __init__(self, core: EngineCore, interval_s: float, logger: logging.Logger) -> None:
        self.core = core
        self.interval_s = interval_s
        self.logger = logger
        self.last_time = time.monotonic()
        self.last_prompt_tokens = core.num_prompt_tokens
        self.last_generation_tokens = core.num_generation_tokens
        self.last_spec = core.spec_stats.copy()
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
        now = self.core.spec_stats
        interval = now.since(self.last_spec)
        assert interval.accepted_per_position is not None
        drafts = interval.num_drafts
        self.logger.info(
            "speculative decoding: mean acceptance length: %.2f, accepted throughput: %.1f tokens/s, drafted "
            "throughput: %.1f tokens/s, accepted: %d tokens, drafted: %d tokens, per-position acceptance rate: %s, "
            "draft acceptance rate: %.1f%%",
            interval.mean_acceptance_length,
            interval.num_accepted_tokens / elapsed,
            interval.num_draft_tokens / elapsed,
            interval.num_accepted_tokens,
            interval.num_draft_tokens,
            ", ".join(f"{n / drafts:.3f}" if drafts else "0.000" for n in interval.accepted_per_position),
            100 * interval.acceptance_rate,
        )
        self.last_spec = now.copy()
