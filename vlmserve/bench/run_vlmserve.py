"""The workload through vlmserve's engine: all requests arrive at once; at most `concurrency`
are in the engine at a time (a new one joins as soon as one finishes)."""

from __future__ import annotations

import time
from collections import deque

from vlmserve.bench.metrics import RequestTiming, RunResult
from vlmserve.bench.workload import BenchRequest
from vlmserve.engine.llm_engine import LLMEngine
from vlmserve.sampling_params import SamplingParams


def run_vlmserve(engine: LLMEngine, requests: list[BenchRequest], concurrency: int, tag: str = "") -> RunResult:
    pending = deque(requests)
    timings: dict[str, RequestTiming] = {}
    in_flight = 0
    start = time.perf_counter()

    def submit() -> None:
        nonlocal in_flight
        request = pending.popleft()
        request_id = f"bench{tag}-{request.index}"
        params = SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
        engine.add_request(request_id, request.prompt, params)
        now = time.perf_counter()
        timings[request_id] = RequestTiming(request.index, request.prompt.num_tokens, 0, now, 0.0, 0.0)
        in_flight += 1

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
