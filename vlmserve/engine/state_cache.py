"""State slots: the per-request memory of fixed size a model with SequenceState layers needs
beside its paged KV (vlmserve.attention.state). A running request holds one slot, taken when it
is admitted (or resumed after a preemption) and given back when it is preempted, finishes or is
aborted; a resumed request recomputes its state from its tokens. The pool holds max_num_seqs
slots (memory planning counts their bytes), so a running request always finds one."""

from __future__ import annotations


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
