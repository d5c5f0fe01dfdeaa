"""The compiled grammars the engine core holds, bounded in bytes (EngineConfig.grammar_cache_bytes,
--grammar-cache-gib), least recently used evicted first.

A compiled grammar is large: xgrammar keeps a token mask per grammar state over the whole
vocabulary (7 MB for the smallest JSON schema under Qwen's 151,936 tokens, 58 MB for one of
10,000 optional properties), in the engine process's memory. So each is counted by its own size
(CompiledGrammar.memory_size_bytes), and every grammar the engine holds is counted, not only the
cached ones: a grammar in use by a request (its matcher holds it) is pinned until the request
releases it. Eviction drops only the cache's reference; a pinned grammar is never evicted, and one
no request uses is freed when it is evicted."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

GrammarKey = tuple[str, str, bool]  # StructuredOutputsParams.key
T = TypeVar("T")


@dataclass
class _Entry(Generic[T]):
    grammar: T
    num_bytes: int
    users: set[str] = field(default_factory=set)  # request ids whose matchers hold it


class GrammarCache(Generic[T]):
    """Compiled grammars by spec key, with the requests that use each."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"the grammar cache needs a positive size, got {capacity_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0  # of every grammar held, pinned or not
        self.pinned_bytes = 0  # of those some request uses
        self._entries: OrderedDict[GrammarKey, _Entry[T]] = OrderedDict()  # least recently used first
        self._pins: dict[str, GrammarKey] = {}  # request id -> the grammar it uses
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: GrammarKey) -> bool:
        return key in self._entries

    def acquire(self, key: GrammarKey, request_id: str) -> T | None:
        """The grammar of `key`, now pinned by `request_id`; None if it is not held."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        self._pin(key, entry, request_id)
        return entry.grammar

    def insert(self, key: GrammarKey, grammar: T, num_bytes: int, request_ids: Iterable[str] = ()) -> None:
        """A newly compiled grammar, pinned by `request_ids`; the least recently used grammars no
        request uses are evicted to make room. The caller refuses a grammar larger than the
        capacity: the cache could hold nothing else."""
        assert num_bytes <= self.capacity_bytes, (num_bytes, self.capacity_bytes)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(grammar, num_bytes)
            self.num_bytes += num_bytes
        self._entries.move_to_end(key)
        for request_id in request_ids:
            self._pin(key, entry, request_id)
        self._evict()

    def release(self, request_ids: Iterable[str]) -> None:
        """The requests no longer use their grammars (finished, aborted, failed)."""
        for request_id in request_ids:
            key = self._pins.pop(request_id, None)
            entry = None if key is None else self._entries.get(key)
            if entry is not None and request_id in entry.users:
                entry.users.discard(request_id)
                if not entry.users:
                    self.pinned_bytes -= entry.num_bytes
        self._evict()

    def has_room(self) -> bool:
        """Whether another grammar may be compiled now: the grammars in use leave room (the others
        are evicted for it). NOTE: the new one's size is known only once compiled, so the bytes
        held may pass the capacity by the grammars compiling at once, while requests use the rest."""
        return self.pinned_bytes < self.capacity_bytes

    @property
    def num_pinned(self) -> int:
        return sum(1 for entry in self._entries.values() if entry.users)

    def _pin(self, key: GrammarKey, entry: _Entry[T], request_id: str) -> None:
        previous = self._pins.get(request_id)
        if previous is not None and previous != key:
            self.release([request_id])
        self._pins[request_id] = key
        if not entry.users:
            self.pinned_bytes += entry.num_bytes
        entry.users.add(request_id)

    def _evict(self) -> None:
        if self.num_bytes <= self.capacity_bytes:
            return
        for key in [k for k, entry in self._entries.items() if not entry.users]:
            self.num_bytes -= self._entries.pop(key).num_bytes
            self.evictions += 1
            if self.num_bytes <= self.capacity_bytes:
                return
