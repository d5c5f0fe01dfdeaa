"""The state cache group beside the paged KV (engine/state_cache.py through the CacheCoordinator),
driven directly: a slot is taken with a request's first blocks and given back with them, a
request that finds no slot takes nothing; prefix caching of a model with state reuses cached KV
only up to a block whose end state is cached (saved where the prompt's last reusable block ends,
committed once its step succeeded, evicted least recently used), and without cached-state slots
not at all."""

from __future__ import annotations

from vlmserve.engine.cache_coordinator import CacheCoordinator
from vlmserve.engine.request import Request
from vlmserve.engine.state_cache import SlotGroupSpec, slot_group_specs
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.sampling_params import SamplingParams


def request(request_id: str, num_tokens: int) -> Request:
    prompt = ProcessedPrompt(prompt_token_ids=list(range(num_tokens)), mm_items=[], mrope_positions=None, mrope_delta=0)
    return Request(request_id, prompt, SamplingParams(max_tokens=4), frozenset(), 1 << 16)


def caches(num_blocks: int, running: int, cached: int = 0, prefix: bool = True) -> CacheCoordinator:
    return CacheCoordinator.build(num_blocks, 4, prefix, [SlotGroupSpec(100, running, cached)])


def test_the_slot_groups_a_model_needs() -> None:
    assert slot_group_specs(0, 8, True) == []  # paged KV alone
    assert slot_group_specs(100, 8, True) == [SlotGroupSpec(100, 8, 8)]  # and as many for saved states
    assert slot_group_specs(100, 8, False) == [SlotGroupSpec(100, 8, 0)]
    assert SlotGroupSpec(100, 8, 8).bytes == 1600


def test_a_slot_comes_with_the_first_blocks_and_goes_with_them() -> None:
    kv = caches(8, running=2)
    assert kv.allocate_slots("a", 5) and kv.allocate_slots("b", 3)
    assert (kv.group_slots("a"), kv.group_slots("b")) == ([0], [1])
    assert kv.allocate_slots("a", 9)  # more blocks for a running request: the same slot
    assert kv.group_slots("a") == [0] and kv.groups[0].slots.num_free == 0
    # No slot left: refused, and no block taken either.
    free_blocks = kv.pool.num_free
    assert not kv.allocate_slots("c", 2)
    assert kv.pool.num_free == free_blocks and "c" not in kv.block_ids
    kv.free("a")  # finished, aborted or preempted alike
    assert kv.allocate_slots("c", 2) and kv.group_slots("c") == [0]
    kv.free("b")
    kv.free("c")
    assert kv.groups[0].slots.num_free == 2 and kv.pool.num_free == 8


def test_a_request_short_of_blocks_takes_no_slot() -> None:
    kv = caches(2, running=2)
    assert not kv.allocate_slots("a", 12)
    assert kv.groups[0].slots.num_free == 2


def test_no_prefix_reuse_with_state_slots_and_no_cached_states() -> None:
    """The KV of a cached prefix is useless without the recurrent state at its last token."""
    kv = caches(8, running=2, cached=0, prefix=True)
    assert not kv.enable_prefix_caching
    first = request("a", 10)
    assert kv.allocate_slots("a", 10)
    kv.step_succeeded(first, 10)
    kv.free("a")
    assert kv.find_cached_prefix(request("b", 10)) == []


def test_a_model_without_state_has_no_group() -> None:
    kv = CacheCoordinator.build(8, 4, True)
    assert kv.groups == [] and kv.allocate_slots("a", 5) and kv.group_slots("a") == []


def _prefill_and_save(kv: CacheCoordinator, req: Request) -> int | None:
    """What the scheduler and runner do for a prompt: compute up to the save point, reserve a
    state slot there, then (the step succeeded) commit. Returns the reserved slot."""
    save_at = kv.groups[0].save_points(req)[-1]
    assert kv.allocate_slots(req.request_id, req.num_tokens)
    assert kv.chunk_end(req, 0, req.num_tokens) == save_at  # a chunk ends at the save point
    copies = kv.copies_after_step(req, save_at)
    kv.step_succeeded(req, save_at)
    kv.step_succeeded(req, req.num_tokens)
    return copies[0][2] if copies else None


def test_a_prefix_is_reused_only_up_to_a_block_whose_state_is_cached() -> None:
    kv = caches(16, running=2, cached=2)
    assert kv.enable_prefix_caching
    a = request("a", 14)  # blocks [0, 4) [4, 8) [8, 12) full; the last a repeat could reuse ends at 12
    assert kv.groups[0].save_points(a) == [12]
    assert _prefill_and_save(kv, a) == 2  # the cached-state slots follow the running ones
    kv.free("a")
    # The same prompt: all three blocks, and the state at token 12 copied into its slot.
    again = request("again", 14)
    assert len(kv.find_cached_prefix(again)) == 3
    assert kv.allocate_slots("again", 14) and kv.copies_on_admission(again, 3) == [(0, 2, kv.group_slots("again")[0])]
    # A prompt sharing the first 10 tokens: blocks 0 and 1 are cached, but no state at 4 or 8.
    shorter = Request(
        "shorter",
        ProcessedPrompt(prompt_token_ids=[*range(10), 99, 98], mm_items=[], mrope_positions=None, mrope_delta=0),
        SamplingParams(max_tokens=4),
        frozenset(),
        1 << 16,
    )
    assert kv.find_cached_prefix(shorter) == []
    # A prompt exactly 12 tokens long saves at 8 (one token is always left to compute).
    assert kv.groups[0].save_points(request("twelve", 12)) == [8]


def test_a_save_becomes_an_entry_only_when_its_step_succeeded_and_entries_age_out() -> None:
    kv = caches(32, running=2, cached=2)
    cached = kv.groups[0].cached
    assert cached is not None
    a = request("a", 9)
    assert kv.allocate_slots("a", 9) and kv.copies_after_step(a, 8) == [(0, 0, 2)]
    kv.free("a")  # ended (aborted, preempted, failed) before its step was committed
    assert not cached.entries and kv.find_cached_prefix(request("a2", 9)) == []
    # Three distinct prompts through two cached-state slots: the least recently used goes.
    prompts = [
        Request(
            f"p{i}",
            ProcessedPrompt(
                prompt_token_ids=[100 * i + t for t in range(9)], mm_items=[], mrope_positions=None, mrope_delta=0
            ),
            SamplingParams(max_tokens=4),
            frozenset(),
            1 << 16,
        )
        for i in range(3)
    ]
    for p in prompts[:2]:
        _prefill_and_save(kv, p)
        kv.free(p.request_id)
    # A hit on p0 (the scheduler takes its state) makes it the most recently used.
    assert len(kv.find_cached_prefix(prompts[0])) == 2
    assert kv.allocate_slots("p0", 9) and kv.copies_on_admission(prompts[0], 2)[0][1] == 2
    kv.free("p0")
    _prefill_and_save(kv, prompts[2])  # evicts p1's state
    kv.free("p2")
    assert kv.find_cached_prefix(prompts[1]) == []
    assert len(kv.find_cached_prefix(prompts[0])) == 2 and len(kv.find_cached_prefix(prompts[2])) == 2
    # A state cached already is not saved twice.
    assert kv.allocate_slots("p0", 9) and kv.copies_after_step(prompts[0], 8) == []


def _ids_request(request_id: str, ids: list[int]) -> Request:
    prompt = ProcessedPrompt(prompt_token_ids=ids, mm_items=[], mrope_positions=None, mrope_delta=0)
    return Request(request_id, prompt, SamplingParams(max_tokens=4), frozenset(), 1 << 16)


END = 7  # the end-of-turn token of these tests


def test_save_points_at_message_ends_every_interval_and_the_last_full_block() -> None:
    groups = [SlotGroupSpec(100, 2, 8)]
    kv = CacheCoordinator.build(64, 4, True, groups, state_save_interval=9, message_end_token_ids={END})
    ids = [100 + i for i in range(30)]
    ids[5] = ids[12] = ids[21] = END  # three messages end: after tokens 5, 12 and 21
    # The first message's end (6 -> 4), the last one's (22 -> 20), every 8 (9 rounded down to
    # blocks of 4), the last full block before the last token (28); the middle end (13) is not one.
    group = kv.groups[0]
    assert group.save_points(_ids_request("a", ids)) == [4, 8, 16, 20, 24, 28]
    # A chunk ends at each, and a save follows each chunk that ends there.
    a = _ids_request("a", ids)
    assert kv.allocate_slots("a", 30)
    assert kv.chunk_end(a, 0, 30) == 4 and kv.chunk_end(a, 4, 30) == 4 and kv.chunk_end(a, 8, 2) == 2
    assert kv.copies_after_step(a, 8) == [(0, 0, 2)] and kv.copies_after_step(a, 12) == []
    # Off by interval: message ends and the last full block only.
    no_interval = CacheCoordinator.build(64, 4, True, [SlotGroupSpec(100, 2, 8)], message_end_token_ids={END})
    assert no_interval.groups[0].save_points(_ids_request("b", ids)) == [4, 20, 28]
    # Without prefix caching there is nothing to save.
    off = CacheCoordinator.build(64, 4, False, [SlotGroupSpec(100, 2, 0)], message_end_token_ids={END})
    assert off.groups[0].save_points(_ids_request("c", ids)) == []


def test_prompts_sharing_their_first_message_reuse_its_state_whatever_follows() -> None:
    kv = CacheCoordinator.build(64, 4, True, [SlotGroupSpec(100, 2, 8)], message_end_token_ids={END})
    system = [*range(100, 113), END]  # 14 tokens: its state is saved at 12
    first = _ids_request("first", [*system, *range(200, 220)])
    assert kv.groups[0].save_points(first) == [12, 32]
    assert kv.allocate_slots("first", first.num_tokens)
    start = 0
    while start < first.num_tokens:  # the scheduler's chunks, each saving where it ends
        end = start + kv.chunk_end(first, start, first.num_tokens - start)
        kv.copies_after_step(first, end)
        kv.step_succeeded(first, end)
        start = end
    kv.free("first")
    # Another question after the same first message: its three blocks and the state at 12.
    second = _ids_request("second", [*system, *range(300, 310)])
    assert len(kv.find_cached_prefix(second)) == 3
