"""Turns engine token updates into RequestOutputs: detokenizes each sample, applies stop
strings, and gathers the n samples of a request into one output."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmserve.engine.core import EngineCoreOutput
from vlmserve.engine.detokenizer import IncrementalDetokenizer
from vlmserve.engine.request import RequestStatus
from vlmserve.outputs import CompletionOutput, RequestOutput
from vlmserve.sampling_params import SamplingParams
from vlmserve.tokenizer import Tokenizer


@dataclass
class _Sample:
    parent: _Parent
    index: int
    detokenizer: IncrementalDetokenizer
    output: CompletionOutput


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_image_tokens: list[int]
    samples: list[_Sample] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.output.finished() for s in self.samples)

    def to_output(self) -> RequestOutput:
        finished = self.finished
        outputs = []
        for s in self.samples:
            o = s.output
            text = s.detokenizer.visible_text(o.finished())
            outputs.append(CompletionOutput(o.index, text, list(o.token_ids), o.finish_reason, o.stop_reason))
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            finished,
            self.num_image_tokens,
            self.num_cached_tokens,
        )


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.samples: dict[str, _Sample] = {}  # child request id -> sample

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        num_image_tokens: list[int],
        params: SamplingParams,
    ) -> list[str]:
        """Register a request; returns the ids of its n engine requests."""
        parent = _Parent(request_id, prompt, prompt_token_ids, num_image_tokens)
        child_ids = []
        for index in range(params.n):
            child_id = child_request_id(request_id, index, params.n)
            sample = _Sample(
                parent, index, IncrementalDetokenizer(self.tokenizer, params), CompletionOutput(index, "", [])
            )
            parent.samples.append(sample)
            self.samples[child_id] = sample
            child_ids.append(child_id)
        self.parents[request_id] = parent
        return child_ids

    def process(self, updates: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of requests that changed, and the engine requests a stop string
        finished (the engine core must free them)."""
        stopped: list[str] = []
        touched: dict[str, _Parent] = {}
        for update in updates:
            sample = self.samples.get(update.request_id)
            if sample is None:
                continue  # aborted here while its step ran
            parent = sample.parent
            parent.num_cached_tokens = max(parent.num_cached_tokens, update.num_cached_tokens)
            sample.output.token_ids.extend(update.new_token_ids)
            finished = update.finish_reason is not None
            stop = sample.detokenizer.update(update.new_token_ids, finished)
            if stop is not None:
                sample.output.finish_reason, sample.output.stop_reason = "stop", stop
                if not finished:
                    stopped.append(update.request_id)
            elif finished:
                sample.output.finish_reason = update.finish_reason
                sample.output.stop_reason = update.stop_reason
            touched[parent.request_id] = parent
        outputs = [parent.to_output() for parent in touched.values()]
        for parent in touched.values():
            if parent.finished:
                self._forget(parent)
        return outputs, stopped

    def abort(self, request_id: str) -> tuple[RequestOutput | None, list[str]]:
        """Mark every unfinished sample of the request aborted; returns the final output and
        the engine requests to free."""
        parent = self.parents.get(request_id)
        if parent is None:
            return None, []
        child_ids = [
            child_request_id(request_id, s.index, len(parent.samples))
            for s in parent.samples
            if not s.output.finished()
        ]
        for s in parent.samples:
            if not s.output.finished():
                s.output.finish_reason = RequestStatus.FINISHED_ABORTED.value
        output = parent.to_output()
        self._forget(parent)
        return output, child_ids

    def _forget(self, parent: _Parent) -> None:
        self.parents.pop(parent.request_id, None)
        for s in parent.samples:
            self.samples.pop(child_request_id(parent.request_id, s.index, len(parent.samples)), None)
