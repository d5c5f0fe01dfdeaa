"""Prometheus metrics of the server (GET /metrics): its own counters, and the engine's numbers
as of its latest stats message (sent every 0.5 s; all zero while no engine runs). Every engine
number is labelled `engine` (its index; "0" for the only one), one series per data-parallel
engine, as vLLM labels its series, so that the spread over engines is visible (sum() for totals).

The engine's numbers and the token counts are published twice: under vlmserve's names, and
under the names `vllm serve` publishes (`vllm:*`, labelled model_name and engine, with vLLM's
histogram buckets), so that dashboards and alerts built for vLLM read vlmserve unchanged. The
per-request series are vLLM's alone: recorded per engine request (each of n samples), from the
timings the API process keeps of it (api/request_stats.py: the engine's events and step times,
the request's arrival)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

from vlmserve.api.request_stats import IterationStats
from vlmserve.ipc.messages import Stats

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that quantiles read the same on both.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def buckets_1_2_5(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(float(m * scale))
        scale *= 10


class _EngineTotal:
    """A vLLM counter fed from an engine total (which restarts at 0 with a new engine process):
    it grows by each increase, and by the whole new total after a restart."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.last = 0

    def update(self, total: int) -> None:
        self.counter.inc(total - self.last if total >= self.last else total)
        self.last = total


class _Families:
    """Each labelled metric made once in a registry, whichever engine's series asks for it first."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.made: dict[str, Any] = {}
        # vllm:cache_config_info: each engine's latest labels, and the gauge that shows them
        self.cache_configs: dict[str, dict[str, str]] = {}
        self.cache_config_info: Gauge | None = None

    def get(self, cls: type[MetricWrapperBase], name: str, doc: str, labels: list[str], **kwargs: Any) -> Any:
        if name not in self.made:
            self.made[name] = cls(name, doc, labels, registry=self.registry, **kwargs)
        return self.made[name]


class Metrics:
    def __init__(
        self, model_name: str = "", max_model_len: int = 4096, num_engines: int = 1, max_loras: int | None = None
    ) -> None:
        """`max_loras`: --max-loras with LoRA enabled (then vllm:lora_requests_info is published), else None."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("vlmserve_requests", "Requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("vlmserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("vlmserve_generation_tokens", "Generated tokens", registry=r)
        self.image_tokens = Counter("vlmserve_image_tokens", "Image placeholder tokens in prompts", registry=r)
        self.in_flight = Gauge("vlmserve_requests_in_flight", "Requests the API process is serving", registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["engine"], registry=r)

        self.waiting = gauge("vlmserve_num_requests_waiting", "Requests queued in the engine")
        self.running = gauge("vlmserve_num_requests_running", "Requests running in the engine")
        self.kv_usage = gauge("vlmserve_kv_cache_usage_ratio", "Fraction of KV blocks in use")
        self.prefix_queries = gauge("vlmserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = gauge("vlmserve_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.encoder_hits = gauge("vlmserve_encoder_cache_hits", "Images served from the encoder cache")
        self.encoder_misses = gauge("vlmserve_encoder_cache_misses", "Images encoded")
        self.preemptions = gauge("vlmserve_preemptions", "Requests preempted since the engine started")
        self.engine_restarts = gauge("vlmserve_engine_restarts", "Times the engine process was restarted")
        self.engine_ready = gauge(
            "vlmserve_engine_ready", "1 while the engine process is running, ready and heard from; else 0"
        )
        families = _Families(r)
        self.vllm_engines = [
            VllmMetrics(r, model_name, max_model_len, engine=str(k), families=families) for k in range(num_engines)
        ]
        self.vllm = self.vllm_engines[0]
        self.lora_info = None if max_loras is None else LoRARequestsInfo(r, max_loras, num_engines)

    def update_engine(self, stats: Stats | None, restarts: int, engine: int = 0, ready: bool = True) -> None:
        """Engine `engine`'s numbers: its latest stats (None while it does not run), its restarts,
        and whether it can take requests now."""
        label = str(engine)
        self.engine_restarts.labels(label).set(restarts)
        self.engine_ready.labels(label).set(1 if ready else 0)
        if stats is None:  # no engine running (not yet, or not any more): it runs and holds nothing
            stats = Stats(0, 0, 0.0, 0, 0, 0, 0, 0)
        self.waiting.labels(label).set(stats.waiting)
        self.running.labels(label).set(stats.running)
        self.kv_usage.labels(label).set(stats.kv_cache_usage)
        self.prefix_queries.labels(label).set(stats.prefix_cache_queries)
        self.prefix_hits.labels(label).set(stats.prefix_cache_hits)
        self.encoder_hits.labels(label).set(stats.encoder_cache_hits)
        self.encoder_misses.labels(label).set(stats.encoder_cache_misses)
        self.preemptions.labels(label).set(stats.preemptions)
        self.vllm_engines[engine].update_engine(stats)
        if self.lora_info is not None:
            self.lora_info.update(engine, stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LoRARequestsInfo:
    """vLLM's vllm:lora_requests_info: one series whose labels name the adapters of the running and
    of the waiting requests (each once, comma-separated; of all engines together) and max_lora, and
    whose value is the time it was last set (Unix seconds), as vLLM sets it each step; the previous
    combination's series is dropped, so the one series there is is the current one."""

    def __init__(self, r: CollectorRegistry, max_loras: int, num_engines: int) -> None:
        self.gauge = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=r,
        )
        self.max_lora = str(max_loras)
        self.engines: list[tuple[list[str], list[str]]] = [([], [])] * num_engines

    def update(self, engine: int, stats: Stats) -> None:
        self.engines[engine] = (stats.running_lora_adapters, stats.waiting_lora_adapters)
        running = dict.fromkeys(name for names, _ in self.engines for name in names)
        waiting = dict.fromkeys(name for _, names in self.engines for name in names)
        self.gauge.clear()
        self.gauge.labels(self.max_lora, ",".join(waiting), ",".join(running)).set_to_current_time()


class VllmMetrics:
    """The series `vllm serve` publishes, under its names, labels and buckets: one engine's
    (label `engine`); the engines of one server share `families`."""

    def __init__(
        self,
        r: CollectorRegistry,
        model_name: str,
        max_model_len: int,
        engine: str = "0",
        families: _Families | None = None,
    ) -> None:
        self.registry = r
        self.engine = engine
        self.families = families = families or _Families(r)
        labels = ["model_name", "engine"]
        values = (model_name, engine)

        def gauge(name: str, doc: str) -> Gauge:
            return families.get(Gauge, name, doc, labels).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return families.get(Counter, name, doc, labels).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return families.get(Histogram, name, doc, labels, buckets=buckets).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = _EngineTotal(
            counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        )
        self.prefix_hits = _EngineTotal(
            counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        )
        self.preemptions = _EngineTotal(
            counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = families.get(
            Counter, "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", [*labels, "source"]
        )
        self.prompt_tokens_by_source = {s: by_source.labels(*values, s) for s in PROMPT_TOKEN_SOURCES}
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        per_position = families.get(
            Counter,
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*labels, "position"],
        )
        self.spec_accepted_per_position = lambda i: per_position.labels(*values, str(i))
        success = families.get(
            Counter, "vllm:request_success", "Count of successfully processed requests.", [*labels, "finished_reason"]
        )
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )
        self.max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self.n_param = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.max_tokens_param = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

    def record(self, stats: IterationStats) -> None:
        """One message of engine outputs (vLLM's PrometheusStatLogger.record, iteration part)."""
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        cached = stats.num_cached_prompt_tokens
        self.prompt_tokens_by_source["local_compute"].inc(stats.num_prompt_tokens - cached)
        self.prompt_tokens_by_source["local_cache_hit"].inc(cached)
        self.prompt_tokens_cached.inc(cached)
        self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.num_spec_drafts:
            self.spec_drafts.inc(stats.num_spec_drafts)
            self.spec_draft_tokens.inc(stats.num_draft_tokens)
            self.spec_accepted_tokens.inc(stats.num_accepted_tokens)
            for i, count in enumerate(stats.accepted_per_position):
                self.spec_accepted_per_position(i).inc(count)
        self.iteration_tokens.observe(stats.num_prompt_tokens + stats.num_generation_tokens)
        for n in stats.n_params:
            self.n_param.observe(n)
        for tokens in stats.max_num_generation_tokens:
            self.max_num_generation_tokens.observe(tokens)
        for ttft in stats.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.itl.observe(itl)
        for finished in stats.finished_requests:
            if finished.finish_reason in self.success:
                self.success[finished.finish_reason].inc()
            self.e2e.observe(finished.e2e_latency)
            self.queue_time.observe(finished.queued_time)
            self.prefill_time.observe(finished.prefill_time)
            self.inference_time.observe(finished.inference_time)
            self.decode_time.observe(finished.decode_time)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            self.request_tpot.observe(finished.mean_time_per_output_token)
            if finished.max_tokens_param:
                self.max_tokens_param.observe(finished.max_tokens_param)

    def log_engine_initialized(self, cache_config: dict[str, str]) -> None:
        """vllm:cache_config_info: the KV cache as each engine (its latest process) built it, in its
        labels, at 1. Labelled like vLLM's: the config's fields and `engine`, no model_name."""
        families = self.families
        families.cache_configs[self.engine] = {**cache_config, "engine": self.engine}
        if families.cache_config_info is not None:
            self.registry.unregister(families.cache_config_info)  # a restarted engine may differ
        names = list(families.cache_configs[self.engine])
        families.cache_config_info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", names, registry=self.registry
        )
        for labels in families.cache_configs.values():
            if list(labels) == names:
                families.cache_config_info.labels(**labels).set(1)

    def update_engine(self, stats: Stats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_queries.update(stats.prefix_cache_queries)
        self.prefix_hits.update(stats.prefix_cache_hits)
        self.preemptions.update(stats.preemptions)
