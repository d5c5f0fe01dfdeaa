"""Beam search with vLLM's semantics, run above the engine as vLLM runs it: every step, each live
beam goes to the engine as a request of its own (the prompt plus the beam's tokens, the prompt's
images carried along) for one token with 2 * beam_width logprobs; the prefix cache gives each of
them the KV of what the beams share, the encoder cache the prompt's image encodings.

The rules, vLLM's (vllm/beam_search.py, BeamSearchOnlineMixin.beam_search):
- candidates of a step: every (beam, token) among the returned logprobs (the top 2 * beam_width
  and the sampled token), scored by cum_logprob = the beam's + the token's raw logprob;
- a candidate ending in eos (the tokenizer's eos_token_id) is finished and set aside, unless
  ignore_eos; the beam_width best others (by cum_logprob in vLLM's server, by score in its
  offline LLM.beam_search: see rank_by_score) are the next step's beams;
- after max_tokens steps (or when no beam is left) the finished and the live beams are ranked
  by cum_logprob / len ** length_penalty, where len counts the PROMPT's tokens too, less a
  trailing eos (vLLM's get_beam_search_score, from transformers' older rule); the beam_width
  best are the answer, best first.

`BeamSearch` holds one prompt's search and does no I/O: a driver (LLM.beam_search, the server's
serving_beam) runs its `beams` through the engine with `step_params` and hands back what each
got, so the offline API and the server share every rule."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import CompletionOutput, Logprob, RequestOutput
from vlmserve.processor.base import ProcessingInfo
from vlmserve.sampling_params import MAX_LOGPROBS, SamplingParams, as_float32, is_int64
from vlmserve.tokenizer import AnyTokenizer

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step asks for 2 * beam_width logprobs


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams. temperature only decides the sampled token each step adds to the
    candidates (0: the most likely, already among them); the logprobs are the model's own."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not is_int64(self.beam_width) or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(
                f"beam_width must be an integer in 1..{MAX_BEAM_WIDTH} (each step asks for 2 * beam_width "
                f"logprobs, at most {MAX_LOGPROBS}), got {self.beam_width!r}"
            )
        if not is_int64(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(as_float32(value)):
                raise ValueError(f"{name} must be a number finite in float32, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")


@dataclass
class BeamSearchSequence:
    """A beam: `tokens` are the prompt's and the generated ones (vLLM's layout)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (eos), or "length" once returned unfinished
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beam_width best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: Sequence[int], cumulative_logprob: float, eos_token_id: int | None, length_penalty: float = 1.0
) -> float:
    """vLLM's score: cum_logprob / len ** length_penalty, len counting the prompt, less a
    trailing eos."""
    seq_len = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


class BeamSearch:
    def __init__(
        self,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        eos_token_id: int | None,
        vocab_size: int,
        max_model_len: int,
        rank_by_score: bool = False,
    ) -> None:
        """rank_by_score: a step's candidates are ranked by their score, as vLLM's offline
        LLM.beam_search does, not by cum_logprob, as its server does. The two differ only where
        ignore_eos lets a candidate end in eos (its length counts one less)."""
        self.rank_by_score = rank_by_score
        self.params = params
        self.eos_token_id = eos_token_id
        self.num_prompt_tokens = len(prompt_token_ids)
        # A beam never outgrows the context (vLLM's server caps max_tokens the same way).
        self.max_steps = max(0, min(params.max_tokens, max_model_len - len(prompt_token_ids)))
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0
        # One token with the top 2 * beam_width logprobs; never more than the vocabulary has.
        self.step_params = SamplingParams(
            n=1,
            max_tokens=1,
            temperature=params.temperature,
            logprobs=min(2 * params.beam_width, vocab_size),
            ignore_eos=True,
        )

    @property
    def done(self) -> bool:
        return self.steps >= self.max_steps or not self.beams

    def advance(self, step_logprobs: Sequence[dict[int, Logprob] | None]) -> None:
        """What each beam of `beams` got this step: its token's logprobs entry (the sampled token
        and the top ones), or None where it got nothing (aborted); such a beam is dropped."""
        assert len(step_logprobs) == len(self.beams), "one result per live beam"
        eos, params = self.eos_token_id, self.params
        candidates: list[tuple[float, int, BeamSearchSequence, dict[int, Logprob]]] = []
        for beam, logprobs in zip(self.beams, step_logprobs, strict=True):
            if not logprobs:
                continue
            for token_id, logprob in logprobs.items():
                cum = beam.cum_logprob + logprob.logprob
                if token_id == eos and not params.ignore_eos:
                    tokens = [*beam.tokens, token_id] if params.include_stop_str_in_output else beam.tokens
                    self.completed.append(
                        BeamSearchSequence(tokens, [*beam.logprobs, logprobs], cum, None, "stop", token_id)
                    )
                else:
                    candidates.append((cum, token_id, beam, logprobs))
        if self.rank_by_score:
            lp = params.length_penalty
            candidates.sort(key=lambda c: get_beam_search_score([*c[2].tokens, c[1]], c[0], eos, lp), reverse=True)
        else:
            candidates.sort(key=lambda c: c[0], reverse=True)  # stable: ties keep beam, then logprob order
        self.beams = [
            BeamSearchSequence([*beam.tokens, token_id], [*beam.logprobs, logprobs], cum)
            for cum, token_id, beam, logprobs in candidates[: params.beam_width]
        ]
        self.steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best of the finished and the live beams, best first (text not filled)."""
        params, eos = self.params, self.eos_token_id

        def score(beam: BeamSearchSequence) -> float:
            return get_beam_search_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)

        ranked = sorted(self.completed + self.beams, key=score, reverse=True)[: params.beam_width]
        for beam in ranked:
            if beam.finish_reason is None:
                beam.finish_reason = "length"
        return ranked

    def generated(self, beam: BeamSearchSequence) -> tuple[list[int], list[int]]:
        """(its generated token ids, the ones its text shows): vLLM leaves a trailing eos out of
        the text even where include_stop_str_in_output keeps it in the ids."""
        ids = beam.tokens[self.num_prompt_tokens :]
        shown = ids[:-1] if ids and ids[-1] == self.eos_token_id and not self.params.ignore_eos else ids
        return ids, shown


# -- running a search -----------------------------------------------------------------------------

# Runs engine requests (prompt, params) to their final outputs, in order; an output may be None
# where a request ended without one (aborted).
RunStep = Callable[[list[ProcessedPrompt], SamplingParams], list[RequestOutput | None]]
AsyncRunStep = Callable[[list[ProcessedPrompt], SamplingParams], Awaitable[list[RequestOutput | None]]]


def beam_eos_token_id(tokenizer: AnyTokenizer, eos_token_ids: frozenset[int]) -> int | None:
    """The one eos a search sets beams aside at: the tokenizer's (vLLM's rule), else the
    smallest of the checkpoint's eos ids."""
    eos = tokenizer.eos_token_id
    return eos if eos is not None else min(eos_token_ids, default=None)


def beam_prompt(prompt: ProcessedPrompt, beam: BeamSearchSequence, processing: ProcessingInfo) -> ProcessedPrompt:
    """The engine request of a beam: the prompt with the beam's tokens appended, the prompt's
    images and videos carried along (same content hashes: the prefix and encoder caches hit),
    positions rebuilt by the family."""
    if len(beam.tokens) == prompt.num_tokens:
        return prompt
    return processing.from_token_ids(beam.tokens, prompt.mm_items)


def _step_logprobs(output: RequestOutput | None) -> dict[int, Logprob] | None:
    if output is None or not output.outputs or not output.outputs[0].logprobs:
        return None
    return output.outputs[0].logprobs[0]


def _requests(
    searches: Sequence[BeamSearch], prompts: Sequence[ProcessedPrompt], processing: ProcessingInfo
) -> list[ProcessedPrompt]:
    return [
        beam_prompt(prompt, beam, processing)
        for search, prompt in zip(searches, prompts, strict=True)
        if not search.done
        for beam in search.beams
    ]


def _advance(searches: Sequence[BeamSearch], outputs: list[RequestOutput | None]) -> None:
    at = 0
    for search in searches:
        if search.done:
            continue
        width = len(search.beams)
        search.advance([_step_logprobs(o) for o in outputs[at : at + width]])
        at += width
    assert at == len(outputs)


def run_beam_search(
    searches: Sequence[BeamSearch], prompts: Sequence[ProcessedPrompt], processing: ProcessingInfo, run: RunStep
) -> None:
    """Every search to its end; each step's beams of all searches go to the engine together."""
    while not all(s.done for s in searches):
        live = [s for s in searches if not s.done]
        requests = _requests(live, [p for s, p in zip(searches, prompts, strict=True) if not s.done], processing)
        _advance(live, run(requests, live[0].step_params))


async def run_beam_search_async(
    search: BeamSearch, prompt: ProcessedPrompt, processing: ProcessingInfo, run: AsyncRunStep
) -> None:
    """One search to its end; `run` submits a step's beams side by side."""
    while not search.done:
        _advance([search], await run(_requests([search], [prompt], processing), search.step_params))


def beam_outputs(
    search: BeamSearch,
    request_id: str,
    prompt: ProcessedPrompt,
    tokenizer: AnyTokenizer,
    skip_special_tokens: bool = True,
    with_logprobs: bool = False,
) -> RequestOutput:
    """The best beams as the server answers them (vLLM's online beam search): each beam a
    choice, its generated ids and their text (without a trailing eos), its cumulative logprob
    (the eos's included), and with_logprobs each token's step entry (the sampled-or-top ones)."""
    outputs = []
    for index, beam in enumerate(search.best()):
        ids, shown = search.generated(beam)
        outputs.append(
            CompletionOutput(
                index,
                tokenizer.decode(shown, skip_special_tokens),
                ids,
                beam.finish_reason,
                beam.stop_reason,
                beam.cum_logprob,
                beam.logprobs[: len(ids)] if with_logprobs else None,  # an eos left out of ids: its entry too
            )
        )
    return RequestOutput(
        request_id,
        prompt.prompt,
        prompt.prompt_token_ids,
        outputs,
        True,
        [item.length for item in prompt.mm_items],
    )
