"""Turns engine token updates into RequestOutputs: detokenizes each sample, applies stop
strings, and gathers the n samples of a request into one output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vlmserve.api.detokenizer import IncrementalDetokenizer
from vlmserve.engine.request import RequestStatus
from vlmserve.ipc.contracts import EngineCoreOutput, TokenLogprobs
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import CompletionOutput, Logprob, MultiModalItemInfo, RequestOutput
from vlmserve.sampling_params import SamplingParams
from vlmserve.tokenizer import AnyTokenizer


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
    mm_items: list[MultiModalItemInfo]
    samples: list[_Sample] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.output.finished() for s in self.samples)

    def to_output(self) -> RequestOutput:
        finished = self.finished
        outputs = []
        for s in self.samples:
            o = s.output
            text = s.detokenizer.visible_text(o.finished())
            logprobs = None if o.logprobs is None else list(o.logprobs)
            outputs.append(
                CompletionOutput(
                    o.index,
                    text,
                    list(o.token_ids),
                    o.finish_reason,
                    o.stop_reason,
                    o.cumulative_logprob,
                    logprobs,
                    o.num_draft_tokens,
                    o.num_accepted_tokens,
                )
            )
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outputs,
            finished,
            [item.length for item in self.mm_items],
            self.num_cached_tokens,
            list(self.mm_items),
            None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class OutputProcessor:
    def __init__(self, tokenizer: AnyTokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.samples: dict[str, _Sample] = {}  # child request id -> sample

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        mm_items: Sequence[MultiModalItemInfo],
    ) -> list[str]:
        """Register a request (its images and videos as the processor took them); returns the ids
        of its n engine requests."""
        parent = _Parent(request_id, prompt, prompt_token_ids, list(mm_items))
        child_ids = []
        for index in range(params.n):
            child_id = child_request_id(request_id, index, params.n)
            sample = _Sample(
                parent,
                index,
                IncrementalDetokenizer(self.tokenizer, params),
                CompletionOutput(index, "", [], logprobs=[] if params.logprobs is not None else None),
            )
            parent.samples.append(sample)
            self.samples[child_id] = sample
            child_ids.append(child_id)
        self.parents[request_id] = parent
        return child_ids

    def add_prompt(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams) -> list[str]:
        """add_request for a processed prompt; returns the ids its n samples run under."""
        items = [MultiModalItemInfo.from_item(item) for item in prompt.mm_items]
        return self.add_request(request_id, prompt.prompt, prompt.prompt_token_ids, params, items)

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
            sample.output.num_draft_tokens += update.num_draft_tokens
            sample.output.num_accepted_tokens += update.num_accepted_tokens
            if update.prompt_logprobs is not None and parent.prompt_logprobs is None:
                # The n samples share the prompt: the first to arrive serves.
                parent.prompt_logprobs = self._prompt_logprobs(parent.prompt_token_ids, update.prompt_logprobs)
            if update.logprobs is not None and sample.output.logprobs is not None:
                self._add_logprobs(sample.output, update.new_token_ids, update.logprobs)
            finished = update.finish_reason is not None
            seen = len(sample.detokenizer.token_ids)
            stop = sample.detokenizer.update(update.new_token_ids, finished, update.finish_reason == "stop")
            if stop is not None:
                # Several tokens at once (accepted drafts): those after the one that completed the
                # stop string are not the output's, as they would not be had they come one by one.
                _drop_last(sample.output, len(update.new_token_ids) - (len(sample.detokenizer.token_ids) - seen))
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

    def _add_logprobs(
        self,
        output: CompletionOutput,
        token_ids: list[int],
        logprobs: list[TokenLogprobs],
    ) -> None:
        assert output.logprobs is not None
        for token_id, info in zip(token_ids, logprobs, strict=True):
            entry = {token_id: Logprob(info.logprob, info.rank, self._token_text(token_id))}
            for top_rank, (top_id, top_logprob) in enumerate(info.top, start=1):
                entry.setdefault(top_id, Logprob(top_logprob, top_rank, self._token_text(top_id)))
            output.logprobs.append(entry)
            output.cumulative_logprob = (output.cumulative_logprob or 0.0) + info.logprob

    def _prompt_logprobs(
        self, prompt_token_ids: list[int], infos: list[TokenLogprobs]
    ) -> list[dict[int, Logprob] | None]:
        """vLLM's shape: None for the first token, then the prompt token's entry and the top ones."""
        entries: list[dict[int, Logprob] | None] = [None]
        for token_id, info in zip(prompt_token_ids[1:], infos, strict=True):
            entry = {token_id: Logprob(info.logprob, info.rank, self._token_text(token_id))}
            for top_rank, (top_id, top_logprob) in enumerate(info.top, start=1):
                entry.setdefault(top_id, Logprob(top_logprob, top_rank, self._token_text(top_id)))
            entries.append(entry)
        return entries

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

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


def _drop_last(output: CompletionOutput, count: int) -> None:
    """The output's last `count` tokens (and their logprobs) removed."""
    if count > 0:
        del output.token_ids[-count:]
        if output.logprobs:
            del output.logprobs[-count:]
