"""Paged KV cache bookkeeping with prefix caching.

Token t of a request lives in block block_ids[t // block_size] at offset t % block_size; its
slot (row in the flattened cache) is block_id * block_size + t % block_size.

Prefix caching: every full block gets a hash chained over its parent block's hash, its token
ids, and the content hashes of the images whose placeholders it holds. Identical placeholder
ids with different pictures therefore hash differently and never share KV. A freed block keeps
its hash and contents until it is reused (least recently freed first), so a later request whose
prompt starts the same way picks the blocks up instead of recomputing them.

This is the cache group of full-attention layers; other kinds of per-request memory are groups
of their own beside it (engine/cache_coordinator.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from vlmserve.engine.request import Request


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Blocks nobody references, oldest-freed first: the order they are reused (evicted) in.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:  # evict its cached contents
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block_id} freed more often than taken"
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def forget_free_blocks(self) -> int:
        """Drop the cached contents of every block nobody holds; returns how many."""
        dropped = 0
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = None
                dropped += 1
        return dropped

    def cache(self, block_id: int, block_hash: bytes) -> None:
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block_id


def hash_block(parent: bytes, token_ids: list[int], mm_keys: tuple[tuple[str, int], ...]) -> bytes:
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    for content_hash, offset in mm_keys:
        h.update(f"|{content_hash}@{offset}".encode())
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_ids: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """Hashes of the request's first `num_blocks` full blocks (computed once, kept)."""
        hashes = request.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            start, end = i * self.block_size, (i + 1) * self.block_size
            mm_keys = tuple(
                (item.content_hash, item.offset) for item in request.mm_items if item.offset < end and item.end > start
            )
            parent = hashes[-1] if hashes else (request.cache_salt or "").encode()
            hashes.append(hash_block(parent, request.token_ids(start, end), mm_keys))
        return hashes[:num_blocks]

    def lookup_prefix(self, request: Request) -> list[int]:
        """Cached blocks matching the start of the request. At least one token is always left to
        compute, so that the last token's logits exist."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self.block_hashes(request, max_blocks):
            block_id = self.pool.cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_query(self, request: Request, num_hit_blocks: int) -> None:
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_hit_blocks * self.block_size

    def find_cached_prefix(self, request: Request) -> list[int]:
        """lookup_prefix, counted in the prefix-cache statistics."""
        hits = self.lookup_prefix(request)
        self.record_prefix_query(request, len(hits))
        return hits

    def can_allocate(self, request_id: str, total_tokens: int, prefix_blocks: Sequence[int] = ()) -> bool:
        """Whether allocate_slots(request_id, total_tokens, prefix_blocks) would succeed."""
        blocks = self.block_ids.get(request_id, [])
        have = len(blocks) or len(prefix_blocks)
        missing = max(0, self.blocks_needed(total_tokens) - have)
        # Hit blocks sitting in the free list stop being free once touched.
        reclaimed = sum(1 for b in prefix_blocks if self.pool.blocks[b].ref_cnt == 0) if not blocks else 0
        return missing + reclaimed <= self.pool.num_free

    def allocate_slots(self, request_id: str, total_tokens: int, prefix_blocks: Sequence[int] = ()) -> bool:
        """Make room for the request's first `total_tokens` tokens, starting from `prefix_blocks`
        (a prefix-cache hit) if it holds none yet. False, and nothing taken, if the pool cannot
        supply the missing blocks."""
        if not self.can_allocate(request_id, total_tokens, prefix_blocks):
            return False
        blocks = self.block_ids.get(request_id, [])
        if not blocks and prefix_blocks:
            self.pool.touch(list(prefix_blocks))
            blocks = list(prefix_blocks)
            self._num_cached_blocks[request_id] = len(blocks)
        blocks.extend(self.pool.allocate(max(0, self.blocks_needed(total_tokens) - len(blocks))))
        self.block_ids[request_id] = blocks
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that became full (their KV is computed)."""
        if not self.enable_prefix_caching:
            return
        full = num_computed_tokens // self.block_size
        done = self._num_cached_blocks.get(request.request_id, 0)
        if full <= done:
            return
        blocks = self.block_ids[request.request_id]
        for i, block_hash in enumerate(self.block_hashes(request, full)[done:], start=done):
            self.pool.cache(blocks[i], block_hash)
        self._num_cached_blocks[request.request_id] = full

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the request's blocks past its first `num_tokens` tokens (held for drafts that were
        rejected: not computed, never cached)."""
        blocks = self.block_ids.get(request_id)
        keep = self.blocks_needed(num_tokens)
        if blocks and len(blocks) > keep:
            assert keep >= self._num_cached_blocks.get(request_id, 0), "a cached block is never trimmed"
            tail = blocks[keep:]
            del blocks[keep:]
            self.pool.free(tail[::-1])

    def free(self, request_id: str) -> None:
        blocks = self.block_ids.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if blocks:
            # Tail first: the start of a prompt is the part other requests most likely share,
            # so it should be the last to be evicted.
            self.pool.free(blocks[::-1])

    def reset(self) -> None:
        """Every block free, no request holding any, nothing cached (statistics kept)."""
        self.pool = BlockPool(self.pool.num_blocks)
        self.block_ids.clear()
        self._num_cached_blocks.clear()

    def forget_cached(self) -> None:
        """Drop the cached contents of every block nobody holds."""
        self.pool.forget_free_blocks()

    def slot(self, request_id: str, token_index: int) -> int:
        blocks = self.block_ids[request_id]
        return blocks[token_index // self.block_size] * self.block_size + token_index % self.block_size

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks
