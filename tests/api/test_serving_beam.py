"""api/serving_beam.py's search driven against a stand-in engine client: a step's beams are
submitted side by side, and cancelling the search (the client gone) closes every request of the
step (the engine client aborts what it closes unfinished) and submits nothing more."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace

import pytest

from vlmserve.api.beam_search import BeamSearchParams
from vlmserve.api.serving_beam import beam_search
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import CompletionOutput, Logprob, RequestOutput
from vlmserve.sampling_params import SamplingParams


class StandInClient:
    """Answers each request with logprobs over 4 tokens (token t: -(1 + t) - last token / 2) once
    `release` is set and, per prompt length, `together` requests have started (a step's beams must all be in flight
    before any is answered); records what it was sent and what was closed before it finished."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.closed_unfinished: list[str] = []
        self.release = asyncio.Event()
        self.together: dict[int, int] = {}  # prompt length -> requests started before any is answered

    async def generate(
        self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        self.started.append(request_id)
        finished = False
        try:
            await self.release.wait()
            need = self.together.get(len(prompt.prompt_token_ids), 1)
            await _wait_for(lambda: len(self.started) >= need, "a step's beams were not submitted together")
            last = prompt.prompt_token_ids[-1]
            logprobs = {t: Logprob(-(1.0 + t) - last / 2, t + 1) for t in range(4)}
            out = CompletionOutput(0, "", [0], "length", None, -1.0, [logprobs])
            finished = True
            yield RequestOutput(request_id, None, prompt.prompt_token_ids, [out], True)
        finally:
            if not finished:
                self.closed_unfinished.append(request_id)


def _frontend() -> SimpleNamespace:
    return SimpleNamespace(
        tokenizer=SimpleNamespace(eos_token_id=3, decode=lambda ids, skip=True: " ".join(map(str, ids))),
        eos_token_ids=frozenset({3}),
        model_config=SimpleNamespace(text=SimpleNamespace(vocab_size=4)),
        max_model_len=100,
        processor=SimpleNamespace(from_token_ids=lambda ids, items: ProcessedPrompt(list(ids), list(items), None, 0)),
    )


def _search(client: StandInClient, beam: BeamSearchParams) -> AsyncGenerator[RequestOutput, None]:
    prompt = ProcessedPrompt([1, 2], [], None, 0)
    return beam_search(client, _frontend(), "req", prompt, beam, SamplingParams(n=beam.beam_width))  # type: ignore[arg-type]


async def _wait_for(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(what)


def test_a_step_s_beams_go_side_by_side_and_the_best_come_back() -> None:
    async def main() -> RequestOutput:
        client = StandInClient()
        client.together = {3: 4}  # step 2's three beams in flight at once (after step 1's one)
        client.release.set()
        return await anext(_search(client, BeamSearchParams(3, 2)))

    final = asyncio.run(main())
    # Step 2's candidates: [0, 0] -3, [0, 1] -4, [1, 0] -4.5, ...; eos (3) endings score worse.
    assert [c.token_ids for c in final.outputs] == [[0, 0], [0, 1], [1, 0]]
    assert [c.cumulative_logprob for c in final.outputs] == [-3.0, -4.0, -4.5]


def test_cancelling_the_search_closes_the_step_s_requests_and_sends_no_more() -> None:
    async def main() -> StandInClient:
        client = StandInClient()
        task = asyncio.ensure_future(anext(_search(client, BeamSearchParams(3, 50))))
        await _wait_for(lambda: len(client.started) == 1, "the first step never started")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        client.release.set()  # were anything still waiting, it would now go on to the next step
        for _ in range(100):
            await asyncio.sleep(0)
        return client

    client = asyncio.run(main())
    assert client.started == ["req-beam0-0"]
    assert client.closed_unfinished == ["req-beam0-0"]
