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
