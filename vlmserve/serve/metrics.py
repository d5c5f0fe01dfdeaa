"""Prometheus metrics of the server (GET /metrics): its own counters, and the engine's numbers
as of its latest stats message (sent every 0.5 s; all zero while no engine runs)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from vlmserve.serve.messages import Stats


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("vlmserve_requests", "Requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("vlmserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("vlmserve_generation_tokens", "Generated tokens", registry=r)
        self.image_tokens = Counter("vlmserve_image_tokens", "Image placeholder tokens in prompts", registry=r)
        self.in_flight = Gauge("vlmserve_requests_in_flight", "Requests the API process is serving", registry=r)
        self.waiting = Gauge("vlmserve_num_requests_waiting", "Requests queued in the engine", registry=r)
        self.running = Gauge("vlmserve_num_requests_running", "Requests running in the engine", registry=r)
        self.kv_usage = Gauge("vlmserve_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.prefix_queries = Gauge(
            "vlmserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Gauge("vlmserve_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self.encoder_hits = Gauge("vlmserve_encoder_cache_hits", "Images served from the encoder cache", registry=r)
        self.encoder_misses = Gauge("vlmserve_encoder_cache_misses", "Images encoded", registry=r)
        self.preemptions = Gauge("vlmserve_preemptions", "Requests preempted since the engine started", registry=r)
        self.engine_restarts = Gauge("vlmserve_engine_restarts", "Times the engine process was restarted", registry=r)

    def update_engine(self, stats: Stats | None, restarts: int) -> None:
        self.engine_restarts.set(restarts)
        if stats is None:  # no engine running (not yet, or not any more): it runs and holds nothing
            stats = Stats(0, 0, 0.0, 0, 0, 0, 0, 0)
        self.waiting.set(stats.waiting)
        self.running.set(stats.running)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_queries.set(stats.prefix_cache_queries)
        self.prefix_hits.set(stats.prefix_cache_hits)
        self.encoder_hits.set(stats.encoder_cache_hits)
        self.encoder_misses.set(stats.encoder_cache_misses)
        self.preemptions.set(stats.preemptions)

    def render(self) -> bytes:
        return generate_latest(self.registry)
