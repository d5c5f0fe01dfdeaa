"""Paged KV cache bookkeeping: a pool of fixed-size blocks and each request's block table.

Token t of a request lives in block block_ids[t // block_size] at offset t % block_size; its
slot (row in the flattened cache) is block_id * block_size + t % block_size.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_ids: dict[str, list[int]] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request_id: str, total_tokens: int) -> bool:
        """Make room for the request's first `total_tokens` tokens. False, and nothing
        allocated, if the pool cannot supply the missing blocks."""
        blocks = self.block_ids.setdefault(request_id, [])
        missing = self.blocks_needed(total_tokens) - len(blocks)
        if missing <= 0:
            return True
        if missing > self.pool.num_free:
            return False
        blocks.extend(self.pool.allocate(missing))
        return True

    def free(self, request_id: str) -> None:
        blocks = self.block_ids.pop(request_id, None)
        if blocks:
            # Freed in reverse so the tail blocks (least likely to be shared later) go out first.
            self.pool.free(blocks[::-1])

    def slot(self, request_id: str, token_index: int) -> int:
        blocks = self.block_ids[request_id]
        return blocks[token_index // self.block_size] * self.block_size + token_index % self.block_size

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks
