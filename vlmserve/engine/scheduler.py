"""Token-budget scheduling (the vLLM v1 idea, in our size), shared fairly among owners.

There is no prefill or decode phase. Each request knows how many of its tokens are computed;
each step hands out at most `max_num_batched_tokens` new tokens: running requests first (one
token for a decoding request, a chunk for one still in its prompt), then waiting requests. A new
request starts after the longest prefix the KV cache already holds.

Requests have an owner: in the server, the HTTP request they serve (its n samples, beams and
prompts share it); the offline API's requests all share one. One owner cannot starve the others:
- waiting requests are admitted one at a time from the owner with the fewest sequences running
  (first come first within an owner, and among equals);
- the step's token budget is split max-min fairly among owners (each gets up to an equal share of
  what is left, and what an owner cannot use goes to the others), so a short prompt is not held
  behind another owner's long prefill;
- when the KV pool runs dry the newest sequence of the owner with the most running is preempted:
  its blocks are freed and it is recomputed later (prompt and generated tokens, from whatever
  prefix is still cached); so it is too when every place (max_num_seqs) is taken and an owner
  waits with nothing running: a request never waits for another's long sequences to end.
With one owner this is plain first-come first-served, preempting the newest.

A chunk may end inside an image's placeholder tokens: the image is encoded when the first chunk
holding any of its placeholders is scheduled, and its encoder output is kept until the last of
them is computed. A chunk stops short of an image that cannot be encoded this step (the
per-step encoder budget is spent, or the encoder cache is full of images in use).

The KV cache and any other kind of per-request memory (cache groups) answer through one
CacheCoordinator: where a prompt may start from cached entries, whether a request may grow, where
a chunk must end, and what to copy within a group around a step's forward.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import Counter, deque
from dataclasses import dataclass

from vlmserve.engine.cache_coordinator import CacheCoordinator
from vlmserve.engine.encoder_cache import EncoderCacheManager
from vlmserve.engine.request import Request, RequestStatus
from vlmserve.ipc.contracts import (
    CachedRequestData,
    EngineCoreEventType,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    # Encoder tokens (merged image embeddings) computed per step and held at once.
    max_encoder_tokens_per_step: int = 8192
    encoder_cache_tokens: int = 16384
    # Speculative decoding by a draft head (mtp): KV slots held past a step's tokens for the
    # head's draft steps, which write its own KV at the positions after them.
    draft_lookahead: int = 0
    # LoRA adapters running at once (requests of another adapter wait until one's requests end);
    # 0: no adapters.
    max_loras: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: CacheCoordinator, log_stats: bool = False) -> None:
        self.config = config
        self.kv = kv
        # Record each request's events (queued, scheduled, preempted) for the server's metrics.
        self.log_stats = log_stats
        self.encoder_cache = EncoderCacheManager(config.encoder_cache_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Requests that ended since the last schedule(): the runner forgets them.
        self.finished_req_ids: list[str] = []
        # Requests whose update raised since the last take_failed(): dropped, everything freed.
        self.failed_req_ids: list[str] = []
        self.num_preemptions = 0  # since start

    # -- admission and removal ------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, item_lengths: list[int]) -> None:
        """Refuse, with the numbers, a request that could never be scheduled."""
        if num_prompt_tokens < 1:
            raise ValueError("the prompt is empty")
        needed = self.kv.blocks_needed(num_prompt_tokens + 1)
        if needed > self.kv.pool.num_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks ({num_prompt_tokens} prompt tokens + 1, {self.kv.block_size} "
                f"per block), the cache has {self.kv.pool.num_blocks} in all"
            )
        largest = max(item_lengths, default=0)
        if largest > self.encoder_cache.capacity:
            raise ValueError(
                f"an image or video of {largest} tokens exceeds the encoder cache "
                f"({self.encoder_cache.capacity} tokens)"
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens, [item.length for item in request.mm_items])
        # NOTE: a request may never hold more KV than the whole pool (a fixed KV size smaller than
        # max_model_len): past it, it would preempt itself and wait forever, holding up the queue.
        # Its last sampled token needs no KV, so it may reach one token past the pool's capacity.
        capacity = self.kv.pool.num_blocks * self.kv.block_size
        request.max_tokens = min(request.max_tokens, capacity - request.num_prompt_tokens + 1)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish (stop string hit) or abort a request: everything it holds is freed at once."""
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self._release(request)

    def _release(self, request: Request) -> None:
        self.kv.free(request.request_id)
        self._release_encoder_outputs(request, upto=None)
        del self.requests[request.request_id]
        if request.sent_to_runner:
            self.finished_req_ids.append(request.request_id)

    def _drop(self, request: Request) -> None:
        """Remove a request whatever state an error left it in, freeing what it holds."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self.requests.pop(request.request_id, None)
        self.kv.free(request.request_id)
        self._release_encoder_outputs(request, upto=None)
        if request.sent_to_runner and request.request_id not in self.finished_req_ids:
            self.finished_req_ids.append(request.request_id)

    def take_failed(self) -> list[str]:
        """Ids of the requests whose update raised since the last call (they are gone)."""
        failed, self.failed_req_ids = self.failed_req_ids, []
        return failed

    def reset(self) -> list[str]:
        """Forget every request and empty the KV pool and the encoder cache: after an error that
        left this state unknown. Returns the ids of the requests it held (the runner must
        forget them too; see ModelRunner.reset)."""
        request_ids = list(dict.fromkeys([*self.requests, *(r.request_id for r in [*self.running, *self.waiting])]))
        self.waiting.clear()
        self.running.clear()
        self.requests.clear()
        self.finished_req_ids = []
        self.failed_req_ids = []
        self.kv.reset()
        self.encoder_cache.reset()
        return request_ids

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        encoder_budget = self.config.max_encoder_tokens_per_step
        preempted = False
        held = Counter(request.owner for request in self.running)
        if len(held) > 1:
            # Smallest holders first (a stable sort: first come first among equals). The victim of a
            # preemption is the last: the newest sequence of the owner with the most running.
            self.running.sort(key=lambda request: held[request.owner])
        self._make_room_for_newcomers(held)
        admissions = self._admission_order(held)
        shares = self._token_shares(admissions, budget)

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            room = min(budget, shares[request.owner])
            n, encoder_tokens = self._fit_encoder(request, start, self._chunk(request, start, room), encoder_budget)
            if n == 0:
                i += 1
                continue
            drafts = self._drafts_to_verify(request, start, n, room)
            lookahead = self.config.draft_lookahead if request.backoff is not None else 0
            while not self.kv.allocate_slots(request.request_id, start + n + len(drafts) + lookahead):
                if drafts or lookahead:
                    drafts, lookahead = [], 0  # the pool is short: a plain step first
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                self._schedule(out, request, n, drafts, lookahead)
                budget -= n + len(drafts)
                shares[request.owner] -= n + len(drafts)
                encoder_budget -= encoder_tokens
                i += 1
                continue
            break  # the request itself was preempted

        adapters = {r.lora_request.lora_name for r in self.running if r.lora_request is not None}
        # After a preemption the pool is known to be short: admit nobody new this step.
        for request in [] if preempted else admissions:
            if budget <= 0:
                break
            lora = request.lora_request
            if lora is not None and lora.lora_name not in adapters and len(adapters) >= self.config.max_loras:
                continue  # max_loras adapters run already: it waits for one of them to end
            room = min(budget, shares[request.owner])
            if room == 0:
                continue  # its owner's share is spent; another's may not be
            # Prompt logprobs need every prompt row computed: no prefix-cache hit (as vLLM) until
            # they are sent with the first output token.
            needs_rows = request.params.prompt_logprobs is not None and not request.output_token_ids
            prefix = [] if needs_rows else self.kv.find_cached_prefix(request)
            start = len(prefix) * self.kv.block_size
            n, encoder_tokens = self._fit_encoder(request, start, self._chunk(request, start, room), encoder_budget)
            if n == 0:
                break
            # A draft head drafts after the prompt's last chunk: KV slots past it, where they are.
            ends_prompt = request.backoff is not None and start + n == request.num_tokens
            lookahead = self.config.draft_lookahead if ends_prompt else 0
            if lookahead and not self.kv.allocate_slots(request.request_id, start + n + lookahead, prefix):
                lookahead = 0
            if not lookahead and not self.kv.allocate_slots(request.request_id, start + n, prefix):
                break
            out.copies_before_forward += self.kv.copies_on_admission(request, len(prefix))
            self.waiting.remove(request)
            request.num_computed_tokens = start
            request.num_cached_tokens = start
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if lora is not None:
                adapters.add(lora.lora_name)
            if self.log_stats:
                request.record_event(EngineCoreEventType.SCHEDULED)
            self._schedule(out, request, n, lookahead=lookahead)
            budget -= n
            shares[request.owner] -= n
            encoder_budget -= encoder_tokens
        out.free_encoder_hashes = self.encoder_cache.take_freed()
        out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, []
        return out

    def _make_room_for_newcomers(self, held: Counter[str]) -> None:
        """Every place taken while an owner waits with nothing running: the newest sequence of the
        owner running the most (two or more) is preempted to make room for it, once for each such
        owner, so that no request waits for another's long sequences to end. (The victim resumes
        from its cached prefix when a place frees.)"""
        if len(self.running) < self.config.max_num_seqs:
            return
        newcomers = {request.owner for request in self.waiting if not held[request.owner]}
        for _ in newcomers:
            victim = self.running[-1]
            if held[victim.owner] < 2:
                return
            self.running.pop()
            self._preempt(victim)
            held[victim.owner] -= 1
            self.running.sort(key=lambda request: held[request.owner])

    def _admission_order(self, held: Counter[str]) -> list[Request]:
        """The waiting requests this step may admit, in the order to try them: one at a time from
        the owner with the fewest sequences running (counting those picked before), first come
        first within an owner and among equals (a preempted request is at the front)."""
        free = self.config.max_num_seqs - len(self.running)
        if free <= 0 or not self.waiting:
            return []
        queues: dict[str, deque[Request]] = {}
        for request in self.waiting:
            queues.setdefault(request.owner, deque()).append(request)
        if len(queues) == 1:
            return list(itertools.islice(self.waiting, free))
        heap = [(held[owner], first, owner) for first, owner in enumerate(queues)]
        heapq.heapify(heap)
        order: list[Request] = []
        while heap and len(order) < free:
            count, first, owner = heapq.heappop(heap)
            queue = queues[owner]
            order.append(queue.popleft())
            if queue:
                heapq.heappush(heap, (count + 1, first, owner))
        return order

    def _token_shares(self, admissions: list[Request], budget: int) -> dict[str, int]:
        """Each owner's most tokens this step: the budget split max-min fairly over what each could
        compute (its running requests' uncomputed tokens and the prompts it may start), the
        smallest demands served whole first and the rest split evenly."""
        demand: Counter[str] = Counter()
        for request in self.running:
            demand[request.owner] += request.num_tokens - request.num_computed_tokens + len(request.spec_token_ids)
        for request in admissions:
            demand[request.owner] += request.num_tokens
        shares = {}
        owners = sorted(demand, key=demand.__getitem__)
        for k, owner in enumerate(owners):
            shares[owner] = min(demand[owner], -(-budget // (len(owners) - k)))  # an even share, rounded up
            budget -= shares[owner]
        return shares

    def _drafts_to_verify(self, request: Request, start: int, n: int, room: int) -> list[int]:
        """The drafts a decoding request verifies this step (as many of its proposed ones as the
        room left after its token)."""
        if not request.spec_token_ids or start + n != request.num_tokens:
            return []
        return request.spec_token_ids[: max(0, room - n)]

    def _chunk(self, request: Request, start: int, budget: int) -> int:
        """The most tokens to compute from `start`: the rest, within the budget, as far as the
        caches let one chunk go."""
        return self.kv.chunk_end(request, start, min(request.num_tokens - start, budget))

    def _fit_encoder(self, request: Request, start: int, n: int, encoder_budget: int) -> tuple[int, int]:
        """Shorten [start, start + n) to end before the first image that cannot be encoded
        this step. Returns (tokens, encoder tokens this chunk would encode)."""
        cache = self.encoder_cache
        space = cache.free_space()
        need = 0
        counted: set[str] = set()
        for item in request.mm_items:
            if item.end <= start or item.offset >= start + n:
                continue
            if cache.has(item.content_hash) or item.content_hash in counted:
                continue
            first_this_step = encoder_budget == self.config.max_encoder_tokens_per_step and need == 0
            if need + item.length > space or (need + item.length > encoder_budget and not first_this_step):
                return max(0, item.offset - start), need
            need += item.length
            counted.add(item.content_hash)
        return n, need

    def _schedule(
        self, out: SchedulerOutput, request: Request, n: int, drafts: list[int] | None = None, lookahead: int = 0
    ) -> None:
        """`drafts`: what the request verifies after its n tokens; `lookahead`: KV slots held past
        them, where its draft head proposes after the step (then it is told how many)."""
        request_id = request.request_id
        out.num_scheduled_tokens[request_id] = n + len(drafts or ())
        if drafts:
            out.scheduled_spec_tokens[request_id] = drafts
        request.spec_token_ids = []
        if lookahead and request.backoff is not None:
            wanted = min(request.backoff.next_count(), request.draft_room)
            if wanted > 0:
                out.num_drafts_wanted[request_id] = wanted
        block_ids = self.kv.block_ids[request_id]
        if not request.sent_to_runner:
            out.scheduled_new_reqs.append(
                NewRequestData(
                    request_id=request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    mm_items=request.mm_items,
                    mrope_positions=request.mrope_positions,
                    mrope_delta=request.mrope_delta,
                    sampling_params=request.params,
                    block_ids=list(block_ids),
                    num_computed_tokens=request.num_computed_tokens,
                    all_stop_token_ids=sorted(request.all_stop_token_ids),
                    group_slots=self.kv.group_slots(request_id),
                    lora_request=request.lora_request,
                    pooling_params=request.pooling_params,
                )
            )
            request.sent_to_runner = True
        else:
            resumed = request.num_sent_blocks < 0
            out.scheduled_cached_reqs.append(
                CachedRequestData(
                    request_id=request_id,
                    resumed_from_preemption=resumed,
                    new_block_ids=list(block_ids if resumed else block_ids[request.num_sent_blocks :]),
                    num_computed_tokens=request.num_computed_tokens,
                    group_slots=self.kv.group_slots(request_id),
                )
            )
        request.num_sent_blocks = len(block_ids)
        start, end = request.num_computed_tokens, request.num_computed_tokens + n
        if not drafts:  # (a state saved after drafts might hold rejected ones: none is)
            out.copies_after_forward += self.kv.copies_after_step(request, end)
        for index, item in enumerate(request.mm_items):
            # Acquire every image this chunk holds placeholders of; encode those not cached.
            in_chunk = item.offset < end and item.end > start
            if in_chunk and self.encoder_cache.acquire(item.content_hash, request_id, item.length):
                out.scheduled_encoder_inputs.setdefault(request_id, []).append(index)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        self._release_encoder_outputs(request, upto=None)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_sent_blocks = -1  # its blocks are gone: the runner gets a whole new list
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        if self.log_stats:
            request.record_event(EngineCoreEventType.PREEMPTED)

    def _release_encoder_outputs(self, request: Request, upto: int | None) -> None:
        """Release the request's hold on encoder outputs of items that end at or before `upto`
        (all items if None)."""
        for item in request.mm_items:
            if upto is None or item.end <= upto:
                self.encoder_cache.release(item.content_hash, request.request_id)

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled tokens, retire finished requests. Returns what
        each request that received a token got. A request whose update raises is dropped alone
        (take_failed() names it); the others are updated as if it had not been there."""
        outputs = []
        for request_id, n in out.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            try:
                output = self._update_request(request, n, out.scheduled_spec_tokens.get(request_id, []), result)
            except Exception:
                logger.exception("updating request %s failed; dropping it", request_id)
                self._drop(request)
                self.failed_req_ids.append(request_id)
                continue
            if output is not None:
                outputs.append(output)
        return outputs

    def _update_request(
        self, request: Request, n: int, drafts: list[int], result: ModelRunnerOutput
    ) -> EngineCoreOutput | None:
        request_id = request.request_id
        tokens = result.sampled_token_ids.get(request_id)
        # Drafts rejected: their KV is not the request's (written over later); a request whose
        # per-request state could not be kept past them computes the step's tokens again.
        accepted = len(tokens) - 1 if tokens is not None and drafts else 0
        kept = result.num_kept_tokens.get(request_id, n - (len(drafts) - accepted))
        request.num_computed_tokens += kept
        self.kv.step_succeeded(request, request.num_computed_tokens)
        self._release_encoder_outputs(request, upto=request.num_computed_tokens)
        pooled = result.pooled.get(request_id)
        if pooled is not None:  # a pooling request's prompt is done: its vector is its output
            request.status = RequestStatus.FINISHED_STOPPED
            self.running.remove(request)
            self._release(request)
            output = EngineCoreOutput(request_id, [], "stop", None, request.num_cached_tokens, pooled=pooled)
            output.events = request.take_events()
            return output
        if tokens is None:
            return None  # a prompt chunk that did not reach the end of the prompt
        if drafts and request.backoff is not None:
            request.backoff.verified(len(drafts), accepted)
        appended = []
        for token in tokens:
            request.append_output_token(token)
            appended.append(token)
            if request.status.finished:
                break
        request.spec_token_ids = result.draft_token_ids.get(request_id, [])
        if accepted < len(drafts) and not request.status.finished:
            self.kv.trim(request_id, request.num_tokens)
            request.num_sent_blocks = -1  # the runner gets its whole (shorter) list next step
        logprobs = result.logprobs.get(request_id)
        output = EngineCoreOutput(
            request_id=request_id,
            new_token_ids=appended,
            finish_reason=request.status.value if request.status.finished else None,
            stop_reason=request.stop_reason if isinstance(request.stop_reason, int) else None,
            num_cached_tokens=request.num_cached_tokens,
            logprobs=None if logprobs is None else logprobs[: len(appended)],
            prompt_logprobs=result.prompt_logprobs.get(request_id),
            events=request.take_events(),
            num_draft_tokens=len(drafts),
            num_accepted_tokens=accepted,
        )
        if request.status.finished:
            self.running.remove(request)
            self._release(request)
        return output
