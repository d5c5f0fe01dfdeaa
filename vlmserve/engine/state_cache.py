"""The state cache group: the per-request memory of fixed size a model with SequenceState layers
(linear attention: vlmserve.attention.state) needs beside its paged KV, as one of the cache
groups behind engine/cache_coordinator.py.

A running request holds one slot, taken with its first KV blocks (when it is admitted, or
resumed after a preemption) and given back with them when it is preempted, finishes or is
aborted; a resumed request recomputes its state from its tokens. The group holds max_num_seqs
such slots (memory planning counts their bytes), so a running request always finds one.

Cached KV is of no use to such a model without the recurrent state at the same token, so its
prefix caching keeps states too: at a prompt's save points a chunk ends and the runner copies the
request's state into a cached-state slot keyed by the hash of the block ending there; a later
request reuses cached blocks only up to the last one whose state is cached, and starts from a
copy of that state. The save points, each rounded down to a block boundary:
- the end of the prompt's first message and of its last complete one (after an end-of-turn
  token: the checkpoint's eos ids, <|im_end|> in every Qwen chat format): requests that share a
  system prompt and tool list share its state whatever follows, and the next turn of a chat
  shares the history;
- every `save_interval` tokens (a long shared document without message ends);
- the prompt's last full block (a repeat of the whole prompt).
Saved states are few (saved_state_slots) and least recently used first out."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

from vlmserve.engine.request import Request


@dataclass(frozen=True)
class SlotGroupSpec:
    """A group of fixed-size per-request slots beside the paged KV: one for each running request,
    and (with prefix caching) as many for states saved at block boundaries."""

    bytes_per_slot: int
    num_running: int
    num_cached: int

    @property
    def num_slots(self) -> int:
        return self.num_running + self.num_cached

    @property
    def bytes(self) -> int:
        return self.bytes_per_slot * self.num_slots


def slot_group_specs(
    slot_bytes: int, max_num_seqs: int, enable_prefix_caching: bool, saved_slots: int | None = None
) -> list[SlotGroupSpec]:
    """The slot groups a model needs: none without per-request state (0 bytes a slot). With prefix
    caching, `saved_slots` saved states (None: max_num_seqs)."""
    if not slot_bytes:
        return []
    saved = (max_num_seqs if saved_slots is None else saved_slots) if enable_prefix_caching else 0
    return [SlotGroupSpec(slot_bytes, max_num_seqs, saved)]


class StateSlotPool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.slot_of: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, request_id: str) -> int:
        assert request_id not in self.slot_of, f"{request_id} already holds state slot {self.slot_of[request_id]}"
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are taken")
        slot = self._free.pop()
        self.slot_of[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)


class CachedStatePool:
    """Prefix caching for a model with per-request state: states saved where a prompt's last
    full block ends, keyed by that block's hash, in slots of their own (after the running
    requests' slots). A cached KV prefix is reusable only up to a block whose state is here;
    entries are evicted least recently used first, independently of the KV blocks (an entry
    whose blocks were evicted is never hit, and ages out).

    A save is reserved when the scheduler ends a chunk at the boundary (the runner copies the
    request's slot into the reserved one after that step's forward) and becomes an entry only
    once the step succeeded (commit); a request that ends before that gives the slot back."""

    def __init__(self, first_slot: int, num_entries: int) -> None:
        self.num_entries = num_entries
        self._free = list(range(first_slot + num_entries - 1, first_slot - 1, -1))  # popped from the end
        self.entries: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, least recently used first
        self.pending: dict[str, tuple[bytes, int]] = {}  # request id -> (block hash, slot) being written

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def lookup(self, block_hash: bytes) -> int:
        """The slot holding the state at the end of this block (now the most recently used)."""
        self.entries.move_to_end(block_hash)
        return self.entries[block_hash]

    def reserve(self, request_id: str, block_hash: bytes) -> int | None:
        """A slot for the request to save its state into this step (a free one, else the least
        recently used entry's); None if every slot is being written."""
        assert request_id not in self.pending, f"{request_id} already saves a state"
        if not self._free:
            if not self.entries:
                return None
            self._free.append(self.entries.popitem(last=False)[1])
        slot = self._free.pop()
        self.pending[request_id] = (block_hash, slot)
        return slot

    def commit(self, request_id: str) -> None:
        """The step that wrote the request's reserved slot succeeded: it becomes an entry."""
        block_hash, slot = self.pending.pop(request_id)
        if block_hash in self.entries:  # saved by another request meanwhile
            self._free.append(slot)
        else:
            self.entries[block_hash] = slot

    def release(self, request_id: str) -> None:
        saved = self.pending.pop(request_id, None)
        if saved is not None:
            self._free.append(saved[1])

    def clear(self) -> int:
        """Drop every entry (reservations stay); returns how many."""
        dropped = len(self.entries)
        self._free.extend(self.entries.values())
        self.entries.clear()
        return dropped


class StateCacheGroup:
    """Per-request state slots and the states saved for prefix caching, as the cache coordinator
    asks a group: can a request take a slot, how much of a cached KV prefix it may reuse, where a
    chunk must end, what to copy before and after a step's forward, what a step made cacheable."""

    def __init__(
        self,
        spec: SlotGroupSpec,
        block_size: int,
        save_interval: int = 0,
        message_end_token_ids: Collection[int] = (),
    ) -> None:
        self.spec = spec
        self.block_size = block_size
        # Whole blocks: a save point is a block boundary (0: none by interval).
        self.save_interval = save_interval // block_size * block_size
        self.message_end_token_ids = frozenset(message_end_token_ids)
        self._save_points: dict[str, list[int]] = {}  # request id -> its save points, once computed
        self.slots = StateSlotPool(spec.num_running)
        # States saved at block boundaries, in slots num_running.. (with prefix caching only).
        self.cached = CachedStatePool(spec.num_running, spec.num_cached) if spec.num_cached else None

    @property
    def caches_prefixes(self) -> bool:
        """NOTE: without cached states, cached KV must never be reused (its state is not there)."""
        return self.cached is not None

    def can_take(self) -> bool:
        return self.slots.num_free > 0

    def take(self, request_id: str) -> None:
        self.slots.allocate(request_id)

    def slot(self, request_id: str) -> int:
        return self.slots.slot_of[request_id]

    def reusable_blocks(self, hashes: list[bytes]) -> int:
        """Of a cached KV prefix whose blocks have these hashes, how many blocks may be reused: as
        far as a block whose end state is cached (the rest is recomputed)."""
        n = len(hashes)
        while n and (self.cached is None or not self.cached.has(hashes[n - 1])):
            n -= 1
        return n

    def save_points(self, request: Request) -> list[int]:
        """Where the request's state is saved, in order (see the module's docstring): block
        boundaries up to the prompt's last full block that a repeat could reuse (one token is
        always left to compute); none without prefix caching."""
        if self.cached is None:
            return []
        points = self._save_points.get(request.request_id)
        if points is None:
            points = self._save_points[request.request_id] = self._find_save_points(request.prompt_token_ids)
        return points

    def _find_save_points(self, ids: list[int]) -> list[int]:
        last = (len(ids) - 1) // self.block_size * self.block_size
        points = {last}
        if self.save_interval:
            points.update(range(self.save_interval, last, self.save_interval))
        ends = self.message_end_token_ids
        first_end = next((i + 1 for i, token in enumerate(ids) if token in ends), None)
        last_end = next((i + 1 for i in range(len(ids) - 1, -1, -1) if ids[i] in ends), None)
        for end in (first_end, last_end):
            if end is not None:
                points.add(end // self.block_size * self.block_size)
        return sorted(p for p in points if 0 < p <= last)

    def chunk_end(self, request: Request, start: int, n: int) -> int:
        """The most of [start, start + n) a chunk may compute: it ends at the first save point inside."""
        for point in self.save_points(request):
            if start < point < start + n:
                return point - start
        return n

    def copies_on_admission(self, request: Request, prefix_hashes: list[bytes]) -> list[tuple[int, int]]:
        """A prefix hit ending with this block hash: its cached state into the request's slot."""
        if not prefix_hashes:
            return []
        assert self.cached is not None
        return [(self.cached.lookup(prefix_hashes[-1]), self.slot(request.request_id))]

    def copies_after_step(self, request: Request, end: int, save_hash: bytes | None) -> list[tuple[int, int]]:
        """A chunk ending at the save point (save_hash: that block's hash): the request's state into
        a reserved cached-state slot, unless it is cached already or every slot is being written."""
        if self.cached is None or save_hash is None or end not in self.save_points(request):
            return []
        if self.cached.has(save_hash) or request.request_id in self.cached.pending:
            return []
        slot = self.cached.reserve(request.request_id, save_hash)
        return [] if slot is None else [(self.slot(request.request_id), slot)]

    def step_succeeded(self, request: Request) -> None:
        """The request's step ran: a state it saved becomes a cache entry."""
        if self.cached is not None and request.request_id in self.cached.pending:
            self.cached.commit(request.request_id)

    def free(self, request_id: str) -> None:
        self.slots.free(request_id)
        self._save_points.pop(request_id, None)
        if self.cached is not None:
            self.cached.release(request_id)

    def reset(self) -> None:
        self.slots = StateSlotPool(self.spec.num_running)
        self._save_points.clear()
        if self.cached is not None:
            self.cached = CachedStatePool(self.spec.num_running, self.spec.num_cached)

    def forget_cached(self) -> None:
        if self.cached is not None:
            self.cached.clear()
