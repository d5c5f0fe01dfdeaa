from __future__ import annotations

import torch

from vlmserve.engine.request import Request
from vlmserve.ipc.contracts import SchedulerOutput
from vlmserve.multimodal.inputs import MultiModalItem, ProcessedPrompt
from vlmserve.sampling_params import SamplingParams


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    images: list[tuple[int, int, str]] = (),  # (offset, length, content hash)
    max_tokens: int = 8,
    max_model_len: int = 4096,
    first_token: int = 0,
    owner: str = "",
) -> Request:
    items = [
        MultiModalItem("image", offset, length, (1, 2, 2 * length), h, torch.zeros(4 * length, 8), (1, 1), (1, 1))
        for offset, length, h in images
    ]
    prompt = ProcessedPrompt(list(range(first_token, first_token + num_prompt_tokens)), items, None, 0)
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), frozenset({99999}), max_model_len, owner)


def encoder_inputs(out: SchedulerOutput) -> list[tuple[str, int]]:
    """(request id, item index) of every image or video the step encodes, in order."""
    return [(request_id, i) for request_id, indexes in out.scheduled_encoder_inputs.items() for i in indexes]
