"""Per-request timings for the metrics, as vLLM's v1 output processor keeps them (its
RequestStateStats, IterationStats and FinishedRequestStats, in our size).

Each engine request (one sample) is timed by the engine's events (queued, first scheduled) and by
the steps that gave it tokens (each StepOutputs carries its step's end on the engine's clock);
TTFT and e2e latency run from the request's arrival at the endpoint, on the API process's clock
(both are time.monotonic(), one clock on one machine). Every message from the engine becomes one
IterationStats, which the metrics record (VllmMetrics.record). Nothing here runs per token: the
engine sends events only when a request changes state, and this runs once per message."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from vlmserve.api.output_processor import child_request_id
from vlmserve.ipc.contracts import EngineCoreEventType, EngineCoreOutput
from vlmserve.outputs import RequestOutput


@dataclass
class ParentStats:
    """A request's n samples: what vLLM records once they have all finished."""

    n: int
    unfinished: int
    max_num_generation_tokens: int = 0


@dataclass
class RequestStateStats:
    """One engine request, as its outputs come in."""

    parent: ParentStats
    arrival_time: float  # the API process's clock
    num_prompt_tokens: int
    max_tokens_param: int
    num_generation_tokens: int = 0
    # The engine's clock; 0.0: not yet.
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0  # the first time (a preemption's later admissions are not counted)
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0


@dataclass(frozen=True)
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int
    queued_time: float  # first QUEUED to first SCHEDULED
    prefill_time: float  # first SCHEDULED to first token (preemptions in it included)
    decode_time: float  # first token to last token
    inference_time: float  # first SCHEDULED to last token: prefill_time + decode_time
    mean_time_per_output_token: float  # decode_time over the tokens after the first (0 for one token)


@dataclass
class IterationStats:
    """What one message of engine outputs did, for the metrics."""

    num_prompt_tokens: int = 0  # of the requests that got their first token in it
    num_cached_prompt_tokens: int = 0  # of those, found in the prefix cache
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # Per request whose samples have all finished: its n, and its longest sample's tokens.
    n_params: list[int] = field(default_factory=list)
    max_num_generation_tokens: list[int] = field(default_factory=list)
    # Speculative decoding: verifications, the drafted tokens they checked, those accepted, and
    # per draft position (0 first) how many verifications accepted it.
    num_spec_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class StatLogger(Protocol):
    """Where the stats go (VllmMetrics)."""

    def record(self, stats: IterationStats) -> None: ...

    def log_engine_initialized(self, cache_config: dict[str, str]) -> None: ...


class RequestStatsTracker:
    def __init__(self) -> None:
        self.requests: dict[str, RequestStateStats] = {}  # engine (child) request id -> its stats
        self.children: dict[str, list[str]] = {}  # request id -> its engine requests

    def add(
        self, request_id: str, child_ids: list[str], num_prompt_tokens: int, max_tokens: int, arrival_time: float
    ) -> None:
        parent = ParentStats(len(child_ids), len(child_ids))
        self.children[request_id] = list(child_ids)
        for child_id in child_ids:
            self.requests[child_id] = RequestStateStats(parent, arrival_time, num_prompt_tokens, max_tokens)

    def forget(self, request_id: str) -> None:
        """A request that ends without finishing (aborted, failed): nothing of it is recorded."""
        for child_id in self.children.pop(request_id, []):
            self.requests.pop(child_id, None)

    def update(
        self, timestamp: float, updates: list[EngineCoreOutput], outputs: list[RequestOutput], now: float
    ) -> IterationStats:
        """One message: `updates` as the engine sent them (at `timestamp`, its clock), `outputs`
        what the detokenizer made of them (which samples finished, stop strings included), `now`
        the API process's clock."""
        stats = IterationStats()
        for update in updates:
            state = self.requests.get(update.request_id)
            if state is None:
                continue  # aborted here while its step ran
            for event in update.events or ():
                if event.type == EngineCoreEventType.QUEUED:
                    state.queued_ts = event.timestamp
                elif event.type == EngineCoreEventType.SCHEDULED and state.scheduled_ts == 0.0:
                    state.scheduled_ts = event.timestamp
            if state.num_generation_tokens == 0:  # its first token: the prompt is done
                stats.num_prompt_tokens += state.num_prompt_tokens
                stats.num_cached_prompt_tokens += update.num_cached_tokens
                stats.time_to_first_tokens.append(now - state.arrival_time)
                state.first_token_ts = timestamp
            else:
                stats.inter_token_latencies.append(timestamp - state.last_token_ts)
            state.last_token_ts = timestamp
            state.num_generation_tokens += len(update.new_token_ids)
            stats.num_generation_tokens += len(update.new_token_ids)
            if update.num_draft_tokens:
                stats.num_spec_drafts += 1
                stats.num_draft_tokens += update.num_draft_tokens
                stats.num_accepted_tokens += update.num_accepted_tokens
                per = stats.accepted_per_position
                per.extend([0] * (update.num_accepted_tokens - len(per)))
                for i in range(update.num_accepted_tokens):
                    per[i] += 1
        for output in outputs:
            for sample in output.outputs:
                if sample.finish_reason is None:
                    continue
                child_id = child_request_id(output.request_id, sample.index, len(output.outputs))
                state = self.requests.pop(child_id, None)
                if state is not None:
                    self._finish(state, sample.finish_reason, now, stats)
            if output.finished:
                self.children.pop(output.request_id, None)
        return stats

    def _finish(self, state: RequestStateStats, finish_reason: str, now: float, stats: IterationStats) -> None:
        decode_time = state.last_token_ts - state.first_token_ts
        after_first = state.num_generation_tokens - 1
        stats.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=now - state.arrival_time,
                num_prompt_tokens=state.num_prompt_tokens,
                num_generation_tokens=state.num_generation_tokens,
                max_tokens_param=state.max_tokens_param,
                queued_time=state.scheduled_ts - state.queued_ts,
                prefill_time=state.first_token_ts - state.scheduled_ts,
                decode_time=decode_time,
                inference_time=state.last_token_ts - state.scheduled_ts,
                mean_time_per_output_token=decode_time / after_first if after_first > 0 else 0.0,
            )
        )
        parent = state.parent
        parent.unfinished -= 1
        parent.max_num_generation_tokens = max(parent.max_num_generation_tokens, state.num_generation_tokens)
        if parent.unfinished == 0:
            stats.n_params.append(parent.n)
            stats.max_num_generation_tokens.append(parent.max_num_generation_tokens)
