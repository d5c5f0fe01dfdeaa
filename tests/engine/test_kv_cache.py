from __future__ import annotations

import pytest

from vlmserve.engine.kv_cache import BlockPool, KVCacheManager


def test_block_pool_hands_out_and_takes_back() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(RuntimeError, match="asked for 2 KV blocks, 1 free"):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free == 4


def test_manager_grows_block_tables_and_maps_slots() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4)
    assert kv.allocate_slots("a", 5)  # 2 blocks
    assert kv.allocate_slots("a", 8)  # still 2
    assert len(kv.block_ids["a"]) == 2
    assert kv.allocate_slots("a", 9)  # a third
    first, second, third = kv.block_ids["a"]
    assert kv.slot("a", 0) == first * 4
    assert kv.slot("a", 6) == second * 4 + 2
    assert kv.slot("a", 8) == third * 4
    assert kv.allocate_slots("b", 8)
    assert not kv.allocate_slots("c", 1)  # pool empty: nothing allocated
    assert "c" not in kv.block_ids or kv.block_ids["c"] == []
    kv.free("a")
    kv.free("b")
    kv.free("c")
    assert kv.pool.num_free == 5 and kv.usage == 0.0


# -- prefix caching -------------------------------------------------------------------------------

from tests.engine.helpers import make_request  # noqa: E402


def _compute(kv: KVCacheManager, request, prefix: list[int] | None = None) -> None:  # type: ignore[no-untyped-def]
    """Pretend the whole prompt was computed: allocate and register its full blocks."""
    assert kv.allocate_slots(request.request_id, request.num_tokens, prefix or [])
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request, request.num_tokens)


def test_same_prompt_reuses_full_blocks_and_leaves_one_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", 12)
    _compute(kv, first)
    twin = make_request("b", 12)
    hit = kv.find_cached_prefix(twin)
    # 12 tokens = 3 full blocks, but the last token must be computed: 2 blocks reused.
    assert hit == kv.block_ids["a"][:2]
    longer = make_request("c", 14)
    assert kv.find_cached_prefix(longer) == kv.block_ids["a"][:3]
    assert kv.prefix_hits == 8 + 12 and kv.prefix_queries == 12 + 14


def test_same_tokens_with_another_image_share_only_blocks_before_it() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    cat = make_request("cat", 16, images=[(6, 8, "cat-pixels")])  # placeholders 6..13: blocks 1..3
    _compute(kv, cat)
    dog = make_request("dog", 16, images=[(6, 8, "dog-pixels")])
    assert kv.find_cached_prefix(dog) == kv.block_ids["cat"][:1]  # block 0 (tokens 0..3) only
    cat_again = make_request("cat2", 16, images=[(6, 8, "cat-pixels")])
    assert kv.find_cached_prefix(cat_again) == kv.block_ids["cat"][:3]
    # The same picture at another offset is another prompt.
    shifted = make_request("shift", 16, images=[(5, 8, "cat-pixels")])
    assert kv.find_cached_prefix(shifted) == kv.block_ids["cat"][:1]


def test_hits_are_shared_by_reference_and_survive_until_evicted() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = make_request("a", 9)
    _compute(kv, a)  # 3 blocks, 2 full and cached
    b = make_request("b", 9)
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 2
    assert kv.allocate_slots("b", 9, hit)
    assert kv.block_ids["b"][:2] == hit and kv.pool.num_free == 2  # shared, plus one new block
    kv.free("a")
    kv.free("b")
    assert kv.pool.num_free == 6
    # Freed, still cached: a third request hits them.
    assert kv.find_cached_prefix(make_request("c", 9)) == hit
    # Filling the pool with other content evicts them (least recently freed first).
    other = make_request("x", 24, first_token=1000)
    _compute(kv, other)
    assert kv.find_cached_prefix(make_request("d", 9)) == []


def test_allocation_counts_reclaimed_hit_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", 9)
    _compute(kv, a)
    kv.free("a")  # 3 blocks free, 2 of them cached
    b = make_request("b", 16)
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 2
    # 16 tokens need 4 blocks: 2 hits (taken off the free list) + 2 new = all 4.
    assert kv.allocate_slots("b", 16, hit)
    assert kv.pool.num_free == 0
    assert not kv.allocate_slots("c", 1)
