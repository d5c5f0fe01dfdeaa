"""The workload through vlmserve's engine: all requests arrive at once; at most `concurrency`
are in the engine at a time (a new one joins as soon as one finishes)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from typing import Any

from vlmserve.bench.metrics import RequestTiming, RunResult
from vlmserve.bench.sampling import JSON_SCHEMA, request_schema
from vlmserve.bench.workload import BenchRequest
from vlmserve.entrypoints.llm_engine import LLMEngine
from vlmserve.progress import progress
from vlmserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


def run_vlmserve(
    engine: LLMEngine,
    requests: list[BenchRequest],
    concurrency: int,
    tag: str = "",
    desc: str | None = None,
    sampling: dict[str, Any] | None = None,
) -> RunResult:
    """`desc`: show progress (output tokens, with an estimate of the time left) under this name.
    `sampling`: SamplingParams fields of every request (bench/sampling.py; default greedy)."""
    fields = dict({"temperature": 0.0} if sampling is None else sampling)
    json_schema = fields.pop(JSON_SCHEMA, False)
    pending = deque(requests)
    timings: dict[str, RequestTiming] = {}
    in_flight = 0
    start = time.perf_counter()

    def submit() -> None:
        nonlocal in_flight
        request = pending.popleft()
        request_id = f"bench{tag}-{request.index}"
        schema = StructuredOutputsParams(json=request_schema(request.index)) if json_schema else None
        params = SamplingParams(**fields, max_tokens=request.output_len, ignore_eos=True, structured_outputs=schema)
        engine.add_request(request_id, request.prompt, params)
        now = time.perf_counter()
        timings[request_id] = RequestTiming(request.index, request.prompt.num_tokens, 0, now, 0.0, 0.0)
        in_flight += 1

    total = sum(r.output_len for r in requests)
    tokens = progress(desc=desc, total=total, unit="token", logger=logger) if desc else None
    with tokens or contextlib.nullcontext():
        while pending and in_flight < concurrency:
            submit()
        while in_flight:
            outputs = engine.step()
            now = time.perf_counter()
            for output in outputs:
                timing = timings[output.request_id]
                produced = len(output.outputs[0].token_ids)
                if timing.output_tokens == 0 and produced:
                    timing.first_token = now
                if tokens is not None:
                    tokens.update(produced - timing.output_tokens)
                timing.output_tokens = produced
                if output.finished:
                    timing.finished = now
                    timing.token_ids = list(output.outputs[0].token_ids)
                    in_flight -= 1
            while pending and in_flight < concurrency:
                submit()
    wall = time.perf_counter() - start
    ordered = sorted(timings.values(), key=lambda t: t.index)
    return RunResult("vlmserve", {"concurrency": concurrency}, wall, ordered)
