"""State slots beside the paged KV (engine/state_cache.py through KVCacheManager), driven
directly: a slot is taken with a request's first blocks and given back with them, a request
that finds no slot takes nothing, and a manager with state slots never reuses cached KV."""

from __future__ import annotations

from vlmserve.engine.kv_cache import KVCacheManager
from vlmserve.engine.request import Request
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.sampling_params import SamplingParams


def request(request_id: str, num_tokens: int) -> Request:
    prompt = ProcessedPrompt(prompt_token_ids=list(range(num_tokens)), mm_items=[], mrope_positions=None, mrope_delta=0)
    return Request(request_id, prompt, SamplingParams(max_tokens=4), frozenset(), 1 << 16)


def test_a_slot_comes_with_the_first_blocks_and_goes_with_them() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, num_state_slots=2)
    assert kv.allocate_slots("a", 5) and kv.allocate_slots("b", 3)
    assert (kv.state_slot("a"), kv.state_slot("b")) == (0, 1)
    assert kv.allocate_slots("a", 9)  # more blocks for a running request: the same slot
    assert kv.state_slot("a") == 0 and kv.state_slots is not None and kv.state_slots.num_free == 0
    # No slot left: refused, and no block taken either.
    free_blocks = kv.pool.num_free
    assert not kv.allocate_slots("c", 2)
    assert kv.pool.num_free == free_blocks and "c" not in kv.block_ids
    kv.free("a")  # finished, aborted or preempted alike
    assert kv.allocate_slots("c", 2) and kv.state_slot("c") == 0
    kv.free("b")
    kv.free("c")
    assert kv.state_slots.num_free == 2 and kv.pool.num_free == 8


def test_a_request_short_of_blocks_takes_no_slot() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4, num_state_slots=2)
    assert not kv.allocate_slots("a", 12)
    assert kv.state_slots is not None and kv.state_slots.num_free == 2


def test_no_prefix_reuse_with_state_slots() -> None:
    """The KV of a cached prefix is useless without the recurrent state at its last token."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True, num_state_slots=2)
    assert not kv.enable_prefix_caching
    first = request("a", 10)
    assert kv.allocate_slots("a", 10)
    kv.cache_blocks(first, 10)
    kv.free("a")
    assert kv.find_cached_prefix(request("b", 10)) == []


def test_a_model_without_state_has_no_pool() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.state_slots is None and kv.allocate_slots("a", 5) and kv.state_slot("a") == -1
