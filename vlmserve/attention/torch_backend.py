"""The reference attention backend: torch's scaled_dot_product_attention over KV gathered from
the paged cache by block table, and per-segment attention for the vision tower; on CPUs where the
vlmserve kernels build, decode reads the paged KV in place and prefill runs a flash kernel."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vlmserve.attention.metadata import AttentionMetadata, decode_row_lens

# (q [num_seqs, heads, dim], kv_cache, block_tables, seq_lens, scale) -> out, or None if it declines
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], "torch.Tensor | None"]
# (q [q_len, heads, dim], k, v [kv_len, kv_heads, dim], scale, causal_offset: None for none, else
# query i sees keys 0 .. causal_offset + i) -> out [q_len, heads, dim], or None if it declines
PrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, "int | None"], "torch.Tensor | None"]


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """Store the step's keys and values at their slots. kv_cache is
    [2, num_blocks, block_size, num_kv_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim]."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)


class TorchAttentionBackend:
    name = "torch"

    def __init__(
        self,
        decode_workspace_tokens: int = 32768,
        decode_kernel: DecodeKernel | None = None,
        prefill_kernel: PrefillKernel | None = None,
    ) -> None:
        # Batched decode gathers each sequence's KV padded to the longest in its group; groups
        # are cut so that (sequences x longest) stays within this many tokens, which bounds the
        # step's transient memory (the memory planner's profile run covers exactly this).
        self.decode_workspace_tokens = decode_workspace_tokens
        # A paged decode kernel reading KV in place (CPU: kernels/cpu_linear.c), where one builds.
        self.decode_kernel = decode_kernel
        # Attention over fresh or gathered K/V (CPU: kernels/cpu_linear_avx512.c); SDPA where it declines.
        self.prefill_kernel = prefill_kernel

    def paged_attention(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over all of its tokens. A sequence's few
        tokens after cached ones (a decode step's one, a verify step's k + 1) run as decode rows
        (attention/metadata.py: decode_row_lens), all of the step's in one kernel call."""
        write_kv(k, v, kv_cache, meta)
        out = torch.empty_like(q)
        decode_tokens: list[int] = []  # the rows of q that attend as decode rows, ascending
        decode_seqs: list[int] = []  # each one's sequence
        decode_lens: list[int] = []  # and the tokens it sees
        for i in range(meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            q_len, seq_len = end - start, meta.seq_lens_host[i]
            row_lens = decode_row_lens(q_len, seq_len)
            if row_lens is not None:
                decode_tokens += range(start, end)
                decode_seqs += [i] * q_len
                decode_lens += row_lens
                continue
            if q_len == seq_len:  # the whole sequence is new: attend to the fresh K/V directly
                keys, values = k[start:end], v[start:end]
            else:
                keys, values = self._gather(kv_cache, meta.block_tables[i], seq_len, meta.block_size)
            out[start:end] = self._attend(q[start:end], keys, values, scale, causal_offset=seq_len - q_len)
        every_token = len(decode_tokens) == q.shape[0]
        if decode_tokens and self.decode_kernel is not None:
            if every_token and meta.num_seqs == q.shape[0]:
                # A decode step: every token is its sequence's one new token, in order; no gathering.
                rows_q, tables, lens = q, meta.block_tables, meta.seq_lens
            else:
                rows_q = q if every_token else q[torch.tensor(decode_tokens, device=q.device)]
                tables = meta.block_tables[torch.tensor(decode_seqs, device=q.device)]
                lens = torch.tensor(decode_lens, dtype=torch.long, device=q.device)
            decoded = self.decode_kernel(rows_q, kv_cache, tables, lens, scale)
            if decoded is not None:
                if every_token:
                    return decoded
                out[torch.tensor(decode_tokens, device=q.device)] = decoded
                return out
        # Longest first, so each group is padded to its own first (longest) row.
        rows = sorted(zip(decode_tokens, decode_seqs, decode_lens, strict=True), key=lambda r: -r[2])
        while rows:
            take = max(1, self.decode_workspace_tokens // rows[0][2])
            self._batched_decode(q, kv_cache, meta, rows[:take], scale, out)
            rows = rows[take:]
        return out

    @staticmethod
    def _gather(
        kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[:num_blocks]
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        keys = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        values = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        return keys, values  # [seq_len, num_kv_heads, head_dim]

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, causal_offset: int | None
    ) -> torch.Tensor:
        """q [q_len, heads, dim] over keys, values [kv_len, kv_heads, dim]: every key with
        causal_offset None, else query j sees keys 0 .. causal_offset + j. The prefill kernel where
        there is one and it takes the inputs, SDPA otherwise."""
        if self.prefill_kernel is not None:
            out = self.prefill_kernel(q, keys, values, scale, causal_offset)
            if out is not None:
                return out
        q_len, kv_len = q.shape[0], keys.shape[0]
        mask = None
        if causal_offset is None:
            causal = False
        elif causal_offset == 0:
            causal = q_len > 1
        else:
            # Query j sits at position causal_offset + j and sees keys 0 .. causal_offset + j.
            causal = False
            rows = torch.arange(q_len, device=q.device)[:, None] + causal_offset
            mask = torch.arange(kv_len, device=q.device)[None, :] <= rows
        # NOTE: 4-D inputs: torch's CPU flash kernel takes only those; 3-D ones fall back to the
        # math path, which materialises the [heads, q_len, kv_len] scores (6x slower, O(n^2) memory).
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=q.shape[1] != keys.shape[1],
        )
        return o[0].transpose(0, 1)

    def _batched_decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rows: list[tuple[int, int, int]],
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Decode rows, (token, its sequence, the tokens it sees) each: gather every row's KV
        padded to the longest and run a single masked attention."""
        token_index = torch.tensor([t for t, _, _ in rows], device=q.device)
        seq_lens = torch.tensor([n for _, _, n in rows], device=q.device)
        max_len = max(n for _, _, n in rows)
        num_blocks = -(-max_len // meta.block_size)
        blocks = meta.block_tables[[i for _, i, _ in rows], :num_blocks]  # [b, nb]
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        b = len(rows)
        keys = kv_cache[0, blocks].reshape(b, -1, num_kv_heads, head_dim)[:, :max_len]
        values = kv_cache[1, blocks].reshape(b, -1, num_kv_heads, head_dim)[:, :max_len]
        # NOTE: padded positions hold stale but finite cache contents; the mask removes them.
        mask = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]  # [b, max_len]
        o = F.scaled_dot_product_attention(
            q[token_index].unsqueeze(2),  # [b, num_heads, 1, head_dim]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=q.shape[1] != num_kv_heads,
        )
        out[token_index] = o.squeeze(2)

    def varlen_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
    ) -> torch.Tensor:
        """Bidirectional attention confined to each segment [cu_seqlens[i], cu_seqlens[i + 1])
        (the vision tower: one segment per image frame). q, k, v: [num_tokens, num_heads, head_dim]."""
        out = torch.empty_like(q)
        for start, end in itertools.pairwise(cu_seqlens):
            out[start:end] = self._attend(q[start:end], k[start:end], v[start:end], scale, causal_offset=None)
        return out
