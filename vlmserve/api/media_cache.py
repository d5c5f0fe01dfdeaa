"""vLLM's media uuids: a content part that gives a `uuid` with its image or video has the media
kept under that uuid (as fetched: the bytes of a URL, the data: URL or path as given, a video's
frames); a later part that gives the same uuid and no media reuses it. The reused item is the same
pixels, so it has the same content hash, and the engine's encoder cache and prefix cache hit on it
as on a repeated image.

The cache is shared by all requests of the server, least recently used first out, bounded in
bytes (each entry costs its media's bytes plus its key); an item larger than the whole bound is
used but not kept. A uuid never sent with media, or evicted since, is a 400 naming it."""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_MEDIA_UUID_CACHE_BYTES = 128 << 20  # 128 MiB
_ENTRY_OVERHEAD = 256  # bytes a key and its bookkeeping cost, roughly


def source_size(source: object) -> int | None:
    """Bytes a source holds (None: not a kind the cache keeps, e.g. a PIL image or an array)."""
    if isinstance(source, (bytes, bytearray)):
        return len(source)
    if isinstance(source, str):
        return len(source.encode("utf-8", "surrogatepass"))
    if isinstance(source, list):
        sizes = [source_size(frame) for frame in source]
        return None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)
    return None


class MediaUUIDCache:
    def __init__(self, max_bytes: int = DEFAULT_MEDIA_UUID_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        # (modality, uuid) -> (source, its size)
        self._entries: OrderedDict[tuple[str, str], tuple[object, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, modality: str, uuid: str, source: object) -> None:
        size = source_size(source)
        key = (modality, uuid)
        self._drop(key)
        if size is None:
            return
        cost = size + len(uuid) + _ENTRY_OVERHEAD
        if cost > self.max_bytes:
            return
        while self.bytes + cost > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = (source, cost)
        self.bytes += cost

    def get(self, modality: str, uuid: str) -> object | None:
        entry = self._entries.get((modality, uuid))
        if entry is None:
            return None
        self._entries.move_to_end((modality, uuid))
        return entry[0]

    def _drop(self, key: tuple[str, str]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1]
