"""The per-request timings (api/request_stats.py) driven with hand-built engine outputs and
timestamps, and recorded into vLLM's series (VllmMetrics.record): every interval is checked to
the exact value vLLM's IterationStats would give for the same events."""

from __future__ import annotations

import pytest

from vlmserve.api.metrics import Metrics
from vlmserve.api.request_stats import RequestStatsTracker
from vlmserve.ipc.contracts import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput
from vlmserve.outputs import CompletionOutput, RequestOutput

Q, S, P = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED


def update(
    child: str, n_tokens: int, events: list[tuple[EngineCoreEventType, float]] | None = None, cached: int = 0
) -> EngineCoreOutput:
    evs = None if events is None else [EngineCoreEvent(t, ts) for t, ts in events]
    return EngineCoreOutput(child, [5] * n_tokens, None, None, cached, events=evs)


def output(request_id: str, reasons: list[str | None]) -> RequestOutput:
    samples = [CompletionOutput(i, "", [], finish_reason=r) for i, r in enumerate(reasons)]
    return RequestOutput(request_id, None, [1] * 10, samples, all(r is not None for r in reasons))


def test_one_request_s_phases_are_the_intervals_between_its_events_and_steps() -> None:
    tracker = RequestStatsTracker()
    tracker.add("r", ["r"], num_prompt_tokens=10, max_tokens=16, arrival_time=100.0)
    # Queued at 100.5, scheduled at 102 (after waiting), first token at 103, then 103.5, 104.5.
    first = tracker.update(103.0, [update("r", 1, [(Q, 100.5), (S, 102.0)], cached=4)], [output("r", [None])], 103.2)
    assert (first.num_prompt_tokens, first.num_cached_prompt_tokens, first.num_generation_tokens) == (10, 4, 1)
    assert first.time_to_first_tokens == [pytest.approx(3.2)]  # from arrival, on the API clock
    assert first.inter_token_latencies == [] and first.finished_requests == []
    second = tracker.update(103.5, [update("r", 1)], [output("r", [None])], 103.6)
    assert second.num_prompt_tokens == 0 and second.inter_token_latencies == [pytest.approx(0.5)]
    # Two tokens in the last step; the API process finishes it at 104.9.
    last = tracker.update(104.5, [update("r", 2)], [output("r", ["length"])], 104.9)
    (done,) = last.finished_requests
    assert done.finish_reason == "length"
    assert done.queued_time == pytest.approx(1.5)
    assert done.prefill_time == pytest.approx(1.0)
    assert done.decode_time == pytest.approx(1.5)
    assert done.inference_time == pytest.approx(2.5)
    assert done.e2e_latency == pytest.approx(4.9)
    assert done.mean_time_per_output_token == pytest.approx(1.5 / 3)  # 4 tokens, 3 after the first
    assert (done.num_prompt_tokens, done.num_generation_tokens, done.max_tokens_param) == (10, 4, 16)
    assert last.n_params == [1] and last.max_num_generation_tokens == [4]
    assert tracker.requests == {} and tracker.children == {}


def test_a_preemption_stays_inside_the_phase_it_interrupted() -> None:
    tracker = RequestStatsTracker()
    tracker.add("r", ["r"], 10, 8, arrival_time=0.0)
    tracker.update(2.0, [update("r", 1, [(Q, 0.5), (S, 1.0)])], [output("r", [None])], 2.0)
    # Preempted at 3 and scheduled again at 4: the queue time still ends at the first admission
    # and the decode phase holds the wait (vLLM's).
    last = tracker.update(5.0, [update("r", 1, [(P, 3.0), (S, 4.0)])], [output("r", ["stop"])], 5.0)
    (done,) = last.finished_requests
    assert (done.queued_time, done.prefill_time, done.decode_time, done.inference_time) == (0.5, 1.0, 3.0, 4.0)


def test_n_samples_are_timed_apart_and_their_request_counted_once_all_finish() -> None:
    tracker = RequestStatsTracker()
    tracker.add("p", ["0_p", "1_p"], 10, 5, arrival_time=0.0)
    both = [update("0_p", 1, [(Q, 0.1), (S, 0.2)]), update("1_p", 1, [(Q, 0.1), (S, 0.2)])]
    first = tracker.update(1.0, both, [output("p", [None, None])], 1.0)
    assert first.num_prompt_tokens == 20  # per sample, as vLLM counts it
    assert len(first.time_to_first_tokens) == 2
    # Sample 0 ends on a stop string (the API process's finish); sample 1 goes on.
    mid = tracker.update(2.0, [update("0_p", 1), update("1_p", 1)], [output("p", ["stop", None])], 2.0)
    assert [f.finish_reason for f in mid.finished_requests] == ["stop"] and mid.n_params == []
    end = tracker.update(3.0, [update("1_p", 1)], [output("p", ["stop", "length"])], 3.0)
    assert [(f.finish_reason, f.num_generation_tokens) for f in end.finished_requests] == [("length", 3)]
    assert end.n_params == [2] and end.max_num_generation_tokens == [3]


def test_a_request_forgotten_before_it_finishes_records_nothing_more() -> None:
    tracker = RequestStatsTracker()
    tracker.add("p", ["0_p", "1_p"], 10, 5, arrival_time=0.0)
    tracker.forget("p")
    stats = tracker.update(1.0, [update("0_p", 1, [(Q, 0.1), (S, 0.2)])], [output("p", ["abort", "abort"])], 1.0)
    assert (stats.num_generation_tokens, stats.finished_requests, stats.n_params) == (0, [], [])


def _sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})


def test_record_feeds_vllm_s_series_per_message_and_per_finished_sample() -> None:
    metrics = Metrics("m", max_model_len=100)
    tracker = RequestStatsTracker()
    tracker.add("p", ["0_p", "1_p"], 10, 5, arrival_time=0.0)
    both = [update("0_p", 1, [(Q, 0.1), (S, 0.2)], cached=4), update("1_p", 1, [(Q, 0.1), (S, 0.4)], cached=4)]
    metrics.vllm.record(tracker.update(1.0, both, [output("p", [None, None])], 1.5))
    metrics.vllm.record(tracker.update(2.0, [update("0_p", 2), update("1_p", 2)], [output("p", ["length"] * 2)], 2.5))
    get = lambda name, **labels: _sample(metrics, name, **labels)  # noqa: E731
    assert get("vllm:prompt_tokens_total") == 20 and get("vllm:generation_tokens_total") == 6
    assert get("vllm:prompt_tokens_cached_total") == 8
    assert get("vllm:prompt_tokens_by_source_total", source="local_compute") == 12
    assert get("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 8
    # One observation per message: 20 prompt + 2 tokens, then 4 tokens.
    assert (get("vllm:iteration_tokens_total_count"), get("vllm:iteration_tokens_total_sum")) == (2, 26)
    assert get("vllm:iteration_tokens_total_bucket", le="8.0") == 1
    assert get("vllm:request_success_total", finished_reason="length") == 2
    assert get("vllm:request_queue_time_seconds_sum") == pytest.approx(0.1 + 0.3)
    assert get("vllm:request_prefill_time_seconds_sum") == pytest.approx(0.8 + 0.6)
    assert get("vllm:request_decode_time_seconds_sum") == pytest.approx(2.0)
    assert get("vllm:request_inference_time_seconds_sum") == pytest.approx(3.4)
    assert get("vllm:time_to_first_token_seconds_sum") == pytest.approx(3.0)
    assert get("vllm:e2e_request_latency_seconds_sum") == pytest.approx(5.0)
    assert get("vllm:inter_token_latency_seconds_count") == 2
    assert get("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(1.0)  # 1 s over 2 tokens, twice
    assert (get("vllm:request_params_n_count"), get("vllm:request_params_n_sum")) == (1, 2)
    assert get("vllm:request_params_n_bucket", le="1.0") == 0 and get("vllm:request_params_n_bucket", le="2.0") == 1
    assert (get("vllm:request_params_max_tokens_count"), get("vllm:request_params_max_tokens_sum")) == (2, 10)
    assert get("vllm:request_max_num_generation_tokens_sum") == 3
    assert (get("vllm:request_generation_tokens_count"), get("vllm:request_generation_tokens_sum")) == (2, 6)


def test_cache_config_info_is_one_series_of_the_latest_engine_s_labels() -> None:
    metrics = Metrics("m")
    metrics.vllm.log_engine_initialized({"block_size": "16", "num_gpu_blocks": "100"})
    metrics.vllm.log_engine_initialized({"block_size": "16", "num_gpu_blocks": "90"})  # a restarted engine
    text = metrics.render().decode()
    lines = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert lines == ['vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="90"} 1.0']
