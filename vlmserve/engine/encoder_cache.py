"""Which encoder outputs the model runner holds, by image content hash, bounded in tokens.

An entry is in use while some request still has placeholders of that image to compute; it is
never dropped then. Entries nobody uses stay, least recently used first out, until their space
is needed: the same picture in a later request is not encoded again while it is cached.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self.sizes: dict[str, int] = {}  # content hash -> tokens
        self.users: dict[str, set[str]] = {}  # content hash -> request ids still needing it
        self.unused: OrderedDict[str, None] = OrderedDict()  # no users; oldest first
        self.used_tokens = 0
        self.hits = 0
        self.misses = 0
        self._freed: list[str] = []

    def has(self, content_hash: str) -> bool:
        return content_hash in self.sizes

    def free_space(self) -> int:
        """Tokens available without touching entries in use."""
        return self.capacity - self.used_tokens + sum(self.sizes[h] for h in self.unused)

    def acquire(self, content_hash: str, request_id: str, num_tokens: int) -> bool:
        """Record that the request needs this output. True if it must be encoded now."""
        if content_hash in self.sizes:
            users = self.users[content_hash]
            if request_id not in users:
                self.hits += 1
                users.add(request_id)
            self.unused.pop(content_hash, None)
            return False
        while self.used_tokens + num_tokens > self.capacity and self.unused:
            evicted, _ = self.unused.popitem(last=False)
            self.used_tokens -= self.sizes.pop(evicted)
            del self.users[evicted]
            self._freed.append(evicted)
        assert self.used_tokens + num_tokens <= self.capacity, "the scheduler checks free_space() first"
        self.misses += 1
        self.sizes[content_hash] = num_tokens
        self.users[content_hash] = {request_id}
        self.used_tokens += num_tokens
        return True

    def release(self, content_hash: str, request_id: str) -> None:
        users = self.users.get(content_hash)
        if users is None or request_id not in users:
            return
        users.discard(request_id)
        if not users:
            self.unused[content_hash] = None

    def evict_unused(self) -> None:
        """Drop every entry no request is using."""
        while self.unused:
            evicted, _ = self.unused.popitem(last=False)
            self.used_tokens -= self.sizes.pop(evicted)
            del self.users[evicted]
            self._freed.append(evicted)

    def reset(self) -> None:
        """Hold nothing (statistics kept); the runner drops its tensors in its own reset."""
        self.sizes.clear()
        self.users.clear()
        self.unused.clear()
        self.used_tokens = 0
        self._freed = []

    def take_freed(self) -> list[str]:
        """Hashes evicted since the last call: the runner drops those tensors."""
        freed, self._freed = self._freed, []
        return freed
