"""A request's memory in the engine, by kind of layer, behind one coordinator the scheduler asks
(vLLM v1's KV-cache groups): the paged KV of full-attention layers (KVCacheManager), and a group
per other kind of per-request memory (the linear-attention layers' fixed-size state:
StateCacheGroup). A model with only full attention has the paged KV alone.

What the scheduler asks, and the coordinator answers for every group at once:
- where a new request's prompt may start from cached entries (find_cached_prefix: the cached KV
  blocks, as far as every group can reuse them),
- whether a request may grow to n tokens (allocate_slots: KV blocks, and a group's slot with the
  first blocks; nothing taken if any group is short),
- where a chunk must end (chunk_end), what to copy within a group before and after the step's
  forward (copies_on_admission, copies_after_step), what became cacheable once the step ran
  (step_succeeded), and what a request holds in each group (group_slots)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from vlmserve.engine.kv_cache import BlockPool, KVCacheManager
from vlmserve.engine.request import Request
from vlmserve.engine.state_cache import SlotGroupSpec, StateCacheGroup, slot_group_specs

# (group, from slot, to slot): a copy within one of the slot groups (the state group's cached
# states), in the order the groups are given.
GroupCopy = tuple[int, int, int]


class CacheCoordinator:
    def __init__(self, kv: KVCacheManager, groups: Sequence[StateCacheGroup] = ()) -> None:
        self.kv = kv
        self.groups = list(groups)

    @classmethod
    def build(
        cls,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        slot_groups: Sequence[SlotGroupSpec] = (),
        state_save_interval: int = 0,
        message_end_token_ids: Collection[int] = (),
    ) -> CacheCoordinator:
        """state_save_interval, message_end_token_ids: where slot groups save states (state_cache.py)."""
        groups = [StateCacheGroup(spec, block_size, state_save_interval, message_end_token_ids) for spec in slot_groups]
        # NOTE: KV reused only where every group can reuse its part of the prefix too.
        prefix = enable_prefix_caching and all(g.caches_prefixes for g in groups)
        return cls(KVCacheManager(num_blocks, block_size, prefix), groups)

    @staticmethod
    def slot_groups(
        slot_bytes: int, max_num_seqs: int, enable_prefix_caching: bool, saved_slots: int | None = None
    ) -> list[SlotGroupSpec]:
        """The slot groups beside the paged KV of a model whose per-request slot is `slot_bytes`
        (0: none), with `saved_slots` saved states (None: max_num_seqs), for the memory plan and build()."""
        return slot_group_specs(slot_bytes, max_num_seqs, enable_prefix_caching, saved_slots)

    # -- what the scheduler reads -------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def pool(self) -> BlockPool:
        return self.kv.pool

    @property
    def block_ids(self) -> dict[str, list[int]]:
        return self.kv.block_ids

    @property
    def enable_prefix_caching(self) -> bool:
        return self.kv.enable_prefix_caching

    @property
    def prefix_queries(self) -> int:
        return self.kv.prefix_queries

    @property
    def prefix_hits(self) -> int:
        return self.kv.prefix_hits

    @property
    def usage(self) -> float:
        return self.kv.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return self.kv.blocks_needed(num_tokens)

    def group_slots(self, request_id: str) -> list[int]:
        """The request's slot in each slot group (empty for a model with paged KV alone)."""
        return [group.slot(request_id) for group in self.groups]

    # -- admission and growth -------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached KV blocks the request may start from: as far as every group can reuse them."""
        hits = self.kv.lookup_prefix(request)
        for group in self.groups:
            hits = hits[: group.reusable_blocks(self.kv.block_hashes(request, len(hits)))]
        self.kv.record_prefix_query(request, len(hits))
        return hits

    def allocate_slots(self, request_id: str, total_tokens: int, prefix_blocks: Sequence[int] = ()) -> bool:
        """Room for the request's first `total_tokens` tokens in every group (a group's slot comes
        with the first blocks). False, and nothing taken, where any group is short."""
        first = request_id not in self.kv.block_ids
        if first and not all(group.can_take() for group in self.groups):
            return False
        if not self.kv.allocate_slots(request_id, total_tokens, prefix_blocks):
            return False
        if first:
            for group in self.groups:
                group.take(request_id)
        return True

    def chunk_end(self, request: Request, start: int, n: int) -> int:
        """How much of [start, start + n) one chunk may compute (a group may need it to end early)."""
        for group in self.groups:
            n = group.chunk_end(request, start, n)
        return n

    def copies_on_admission(self, request: Request, num_prefix_blocks: int) -> list[GroupCopy]:
        """What a prefix hit of num_prefix_blocks blocks needs copied before the forward."""
        hashes = self.kv.block_hashes(request, num_prefix_blocks)
        return [(g, a, b) for g, group in enumerate(self.groups) for a, b in group.copies_on_admission(request, hashes)]

    def copies_after_step(self, request: Request, end: int) -> list[GroupCopy]:
        """What a chunk computing the request up to `end` should save after the forward."""
        if not self.groups or not self.kv.enable_prefix_caching or end % self.kv.block_size or end == 0:
            return []
        (save_hash,) = self.kv.block_hashes(request, end // self.kv.block_size)[-1:]
        copies = [(g, group.copies_after_step(request, end, save_hash)) for g, group in enumerate(self.groups)]
        return [(g, a, b) for g, pairs in copies for a, b in pairs]

    def step_succeeded(self, request: Request, num_computed_tokens: int) -> None:
        """The request's step ran: its full blocks (and whatever a group saved) become cacheable."""
        if self.kv.enable_prefix_caching:
            for group in self.groups:
                group.step_succeeded(request)
        self.kv.cache_blocks(request, num_computed_tokens)

    # -- release ------------------------------------------------------------------------------

    def trim(self, request_id: str, num_tokens: int) -> None:
        """The request's KV blocks past its first num_tokens tokens, freed (its group slots stay)."""
        self.kv.trim(request_id, num_tokens)

    def free(self, request_id: str) -> None:
        self.kv.free(request_id)
        for group in self.groups:
            group.free(request_id)

    def reset(self) -> None:
        """Every group empty, nothing cached (statistics kept)."""
        self.kv.reset()
        for group in self.groups:
            group.reset()

    def forget_cached(self) -> None:
        """Drop cached entries nobody holds, in every group."""
        self.kv.forget_cached()
        for group in self.groups:
            group.forget_cached()
