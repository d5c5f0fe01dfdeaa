"""vLLM's `use_beam_search` in the server: `n` beams searched by vlmserve.api.beam_search's
rules, each step's beams submitted side by side through the engine client (one engine request
of one token per beam), the `n` best answered as the choices, best first. As in vLLM the answer
comes whole at the end: a stream carries it in one chunk per choice. Cancelling the search (the
client gone) cancels the step's requests, and the engine client aborts each."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator
from contextlib import aclosing

from vlmserve.api.beam_search import (
    BeamSearch,
    BeamSearchParams,
    beam_eos_token_id,
    beam_outputs,
    run_beam_search_async,
)
from vlmserve.api.dp_client import DataParallelClient
from vlmserve.api.frontend import Frontend
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import RequestOutput
from vlmserve.sampling_params import SamplingParams


def beam_search_params(params: SamplingParams, length_penalty: float, max_model_len: int) -> BeamSearchParams:
    """vLLM's to_beam_search_params: n is the beam width; max_tokens, ignore_eos, temperature
    (the generation config's default when not given) and include_stop_str_in_output as asked.
    The request was checked (protocol.py), so nothing here is refused."""
    return BeamSearchParams(
        beam_width=params.n,
        max_tokens=params.max_tokens or max_model_len,
        ignore_eos=params.ignore_eos,
        temperature=params.temperature,
        length_penalty=length_penalty,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )


async def beam_search(
    client: DataParallelClient,
    frontend: Frontend,
    request_id: str,
    prompt: ProcessedPrompt,
    beam: BeamSearchParams,
    params: SamplingParams,
) -> AsyncGenerator[RequestOutput, None]:
    """Yields the one final output: the best beams as choices (logprobs when `params` asks)."""
    eos = beam_eos_token_id(frontend.tokenizer, frontend.eos_token_ids)
    search = BeamSearch(
        prompt.prompt_token_ids, beam, eos, frontend.model_config.text.vocab_size, frontend.max_model_len
    )
    steps = itertools.count()

    async def run(prompts: list[ProcessedPrompt], step_params: SamplingParams) -> list[RequestOutput | None]:
        step = next(steps)
        tasks = [
            asyncio.create_task(_final(client, f"{request_id}-beam{step}-{i}", p, step_params))
            for i, p in enumerate(prompts)
        ]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # one failed or the search was cancelled: the others end (aborted) too
                task.cancel()

    await run_beam_search_async(search, prompt, frontend.processor, run)
    yield beam_outputs(
        search, request_id, prompt, frontend.tokenizer, params.skip_special_tokens, params.logprobs is not None
    )


async def _final(
    client: DataParallelClient, request_id: str, prompt: ProcessedPrompt, params: SamplingParams
) -> RequestOutput | None:
    final = None
    async with aclosing(client.generate(request_id, prompt, params)) as outputs:
        async for output in outputs:
            final = output
    return final
