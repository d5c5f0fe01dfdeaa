"""Drafts chosen by a test: an engine whose drafts are each request's known answer, wrong here and
there, so that verification (whole drafts accepted, some cut short) runs whatever the weights."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

# (the answer, tokens the request has produced) -> its drafts for the next step
Drafter = Callable[[list[int], int], list[int]]


def right_but_one_every_third(answer: list[int], done: int) -> list[int]:
    """The answer's next 4 tokens, the second of them wrong every third step."""
    drafts = list(answer[done : done + 4])
    if done % 3 == 0 and len(drafts) > 1:
        drafts[1] = (drafts[1] + 1) % 1000
    return drafts


@contextlib.contextmanager
def oracle_drafts(
    core: Any, answers: dict[tuple[int, ...], list[int]], drafter: Drafter = right_but_one_every_third
) -> Iterator[None]:
    """The engine core's drafts (an EngineCore with speculative decoding on) replaced, while
    inside, by `drafter`'s from each decoding request's answer, found by its prompt's token ids."""
    original = core._propose_drafts

    def propose() -> None:
        for request in core.scheduler.running:
            if request.is_decoding:
                answer = answers[tuple(request.prompt_token_ids)]
                drafts = drafter(answer, len(request.output_token_ids))
                request.spec_token_ids = core.structured_outputs.allowed_drafts(request.request_id, drafts)

    core._propose_drafts = propose
    try:
        yield
    finally:
        core._propose_drafts = original
