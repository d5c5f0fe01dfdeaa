"""The media uuid cache: bounded in bytes, least recently used out, oversized items not kept."""

from __future__ import annotations

from vlmserve.api.media_cache import MediaUUIDCache, source_size


def test_the_cache_stays_within_its_bytes_evicting_the_least_recently_used() -> None:
    cache = MediaUUIDCache(max_bytes=3300)  # three entries of ~1057 bytes with overheads
    cache.put("image", "a", b"x" * 800)
    cache.put("image", "b", b"y" * 800)
    cache.put("image", "c", "data:," + "z" * 794)
    assert cache.get("image", "a") == b"x" * 800  # a is now the most recently used
    cache.put("image", "d", b"w" * 800)  # a fourth does not fit: b, the least recently used, goes
    assert cache.get("image", "b") is None
    assert cache.get("image", "a") is not None and cache.get("image", "d") is not None
    assert cache.bytes <= cache.max_bytes and len(cache) == 3
    cache.put("image", "huge", b"h" * 5000)  # larger than the bound: not kept, nothing evicted
    assert cache.get("image", "huge") is None and len(cache) == 3
    cache.put("image", "a", b"short")  # replaced: its old bytes freed
    assert cache.get("image", "a") == b"short"
    assert cache.bytes == sum(cost for _, cost in cache._entries.values())
    assert cache.get("video", "a") is None  # keyed by modality too


def test_sizes_of_sources() -> None:
    assert source_size(b"abc") == 3 and source_size("é") == 2 and source_size([b"ab", "c"]) == 3
    assert source_size(object()) is None
