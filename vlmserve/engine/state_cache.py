"""State slots: the per-request memory of fixed size a model with SequenceState layers needs
beside its paged KV (vlmserve.attention.state). A running request holds one slot, taken when it
is admitted (or resumed after a preemption) and given back when it is preempted, finishes or is
aborted; a resumed request recomputes its state from its tokens. The pool holds max_num_seqs
slots (memory planning counts their bytes), so a running request always finds one."""

from __future__ import annotations

from collections import OrderedDict


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
