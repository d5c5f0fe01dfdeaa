"""PoolingServing's engine side on a stand-in client: a request's prompts are all handed to the
engine before any is awaited (so they run in the same steps), and one refused fails the request
with a 400 while its siblings are cancelled (their engine requests aborted)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from vlmserve.api.engine_client import RequestRefused
from vlmserve.api.metrics import Metrics
from vlmserve.api.serving_pooling import PoolingServing
from vlmserve.errors import APIError
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import PoolingOutput, PoolingRequestOutput
from vlmserve.pooling import PoolingParams


class GatedClient:
    """Answers no request until `count` of them are in flight at once; `refuse`: the index of a
    request refused once they all are."""

    def __init__(self, count: int, refuse: int | None = None) -> None:
        self.count, self.refuse = count, refuse
        self.started: list[str] = []
        self.cancelled: list[str] = []
        self.all_in = asyncio.Event()

    async def pool(self, request_id: str, prompt: ProcessedPrompt, params: PoolingParams) -> PoolingRequestOutput:
        index = len(self.started)
        self.started.append(request_id)
        if len(self.started) == self.count:
            self.all_in.set()
        try:
            await asyncio.wait_for(self.all_in.wait(), 10)
            if index == self.refuse:
                raise RequestRefused("the prompt is empty")
            if self.refuse is not None:
                await asyncio.sleep(10)  # still running when its sibling is refused
            return PoolingRequestOutput(request_id, PoolingOutput(torch.full((2,), float(index))), [index])
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise


def _serving(client: GatedClient) -> PoolingServing:
    ctx = SimpleNamespace(client=client, metrics=Metrics("tiny", 512))
    return PoolingServing(ctx, None)  # type: ignore[arg-type]


def _prompts(n: int) -> list[ProcessedPrompt]:
    return [ProcessedPrompt([7] * (i + 1), [], None, 0) for i in range(n)]


def test_a_requests_prompts_are_all_in_the_engine_before_any_is_awaited() -> None:
    client = GatedClient(4)
    outputs = asyncio.run(_serving(client)._pool(_prompts(4), PoolingParams(), "embd"))
    assert [float(o.outputs.data[0]) for o in outputs] == [0.0, 1.0, 2.0, 3.0]  # in the prompts' order
    assert len(set(client.started)) == 4 and client.cancelled == []


def test_one_refused_prompt_fails_the_request_and_cancels_the_others() -> None:
    client = GatedClient(3, refuse=1)
    with pytest.raises(APIError) as refused:
        asyncio.run(_serving(client)._pool(_prompts(3), PoolingParams(), "embd"))
    assert refused.value.status == 400 and refused.value.message == "the prompt is empty"
    assert sorted(client.cancelled) == sorted([client.started[0], client.started[2]])
