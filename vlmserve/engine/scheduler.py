"""Token-budget scheduling (the vLLM v1 idea, in our size).

There is no prefill or decode phase. Each request knows how many of its tokens are computed;
each step hands out at most `max_num_batched_tokens` new tokens: running requests first (one
token for a decoding request, a chunk for one still in its prompt), then waiting requests in
arrival order. A prompt longer than the remaining budget is computed in chunks, and a chunk may
end inside an image's placeholder tokens: that image is encoded once, when its first
placeholder is scheduled, and its encoder output is kept until its last placeholder is computed.
When the KV pool runs dry the newest running request is preempted: its blocks are freed and it
is recomputed from scratch later, its generated tokens kept.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from vlmserve.engine.kv_cache import KVCacheManager
from vlmserve.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768


@dataclass
class SchedulerOutput:
    # (request, number of its tokens to compute this step), in batch order.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    # Images to encode this step: (request, index into request.mm_items).
    encoder_inputs: list[tuple[Request, int]] = field(default_factory=list)
    # Encoder outputs (by content hash) no request needs any more.
    free_encoder_hashes: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Encoder outputs held by the runner: content hash -> ids of requests that still need it.
        self.encoder_refs: dict[str, set[str]] = {}
        self._free_hashes: list[str] = []

    # -- admission and removal ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        needed = self.kv.blocks_needed(request.num_prompt_tokens + 1)
        if needed > self.kv.pool.num_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks for its {request.num_prompt_tokens}-token prompt, "
                f"the cache has {self.kv.pool.num_blocks} in all"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish (stop string hit) or abort a request: everything it holds is freed at once."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self._release(request)

    def _release(self, request: Request) -> None:
        self.kv.free(request.request_id)
        self._drop_encoder_refs(request, upto=None)
        del self.requests[request.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(free_encoder_hashes=self._free_hashes)
        self._free_hashes = []
        budget = self.config.max_num_batched_tokens

        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + n):
                victim = self.running.pop()  # the newest
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                self._schedule(out, request, n)
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted

        # After a preemption the pool is known to be short: admit nobody new this step.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + n):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._schedule(out, request, n)
            budget -= n
        return out

    def _schedule(self, out: SchedulerOutput, request: Request, n: int) -> None:
        out.scheduled.append((request, n))
        start, end = request.num_computed_tokens, request.num_computed_tokens + n
        for index, item in enumerate(request.mm_items):
            if item.offset < end and item.end > start:  # this chunk holds some of its placeholders
                refs = self.encoder_refs.get(item.content_hash)
                if refs is None:
                    refs = self.encoder_refs[item.content_hash] = set()
                    out.encoder_inputs.append((request, index))
                refs.add(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        self._drop_encoder_refs(request, upto=None)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _drop_encoder_refs(self, request: Request, upto: int | None) -> None:
        """Release the request's hold on encoder outputs of items that end at or before `upto`
        (all items if None)."""
        for item in request.mm_items:
            if upto is not None and item.end > upto:
                continue
            refs = self.encoder_refs.get(item.content_hash)
            if refs is None or request.request_id not in refs:
                continue
            refs.discard(request.request_id)
            if not refs:
                del self.encoder_refs[item.content_hash]
                self._free_hashes.append(item.content_hash)

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, retire finished requests. Returns the
        requests that received a token this step."""
        updated = []
        for request, n in out.scheduled:
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += n
            self._drop_encoder_refs(request, upto=request.num_computed_tokens)
            token = sampled.get(request.request_id)
            if token is None:
                continue  # a prompt chunk that did not reach the end of the prompt
            request.append_output_token(token)
            updated.append(request)
            if request.status.finished:
                self.running.remove(request)
                self._release(request)
        return updated
