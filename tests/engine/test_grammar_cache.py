"""The compiled-grammar cache: bounded in bytes, least recently used evicted first, and a grammar
a request uses never evicted under it (driven directly, with stand-ins for compiled grammars)."""

from __future__ import annotations

import pytest

from vlmserve.engine.grammar_cache import GrammarCache

MB = 1_000_000


def key(i: int) -> tuple[str, str, bool]:
    return ("json", f'{{"const": {i}}}', True)


def test_bytes_bound_and_least_recently_used_first() -> None:
    cache: GrammarCache[str] = GrammarCache(20 * MB)
    for i in range(3):
        cache.insert(key(i), f"g{i}", 7 * MB)  # nobody uses them
    assert cache.num_bytes == 14 * MB and key(0) not in cache and cache.evictions == 1
    assert cache.acquire(key(1), "r") == "g1" and cache.hits == 1  # now the most recently used
    cache.release(["r"])
    cache.insert(key(3), "g3", 7 * MB)
    assert key(2) not in cache and key(1) in cache and key(3) in cache
    assert cache.acquire(key(2), "r2") is None and cache.misses == 1
    assert cache.num_bytes <= cache.capacity_bytes


def test_a_grammar_in_use_is_not_evicted_and_counts_until_released() -> None:
    cache: GrammarCache[str] = GrammarCache(20 * MB)
    cache.insert(key(0), "g0", 12 * MB, ["a"])
    cache.insert(key(1), "g1", 12 * MB, ["b"])  # both in use: over the capacity while they run
    assert cache.num_bytes == cache.pinned_bytes == 24 * MB and cache.num_pinned == 2 and not cache.has_room()
    assert cache.acquire(key(0), "c") == "g0"
    cache.release(["a"])  # "c" still uses it
    assert key(0) in cache and cache.num_bytes == 24 * MB
    cache.release(["c"])
    assert key(0) not in cache and cache.num_bytes == 12 * MB and cache.has_room()
    cache.release(["b"])
    assert key(1) in cache and cache.pinned_bytes == 0  # within the capacity: kept for the next request
    cache.insert(key(2), "g2", 8 * MB)
    assert cache.num_bytes == 20 * MB and cache.has_room()  # full, but nothing in use: room by eviction
    cache.release(["nobody"])  # unknown ids are ignored


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        GrammarCache(0)
