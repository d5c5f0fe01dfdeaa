"""Attention metadata: built by the model runner each step and passed down as an argument."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

# A sequence computing up to this many new tokens after tokens already in the KV cache (a
# speculative-decoding verify step's k + 1) runs them as decode rows: one per token, each with
# the sequence's block table and its own length (row j of n sees seq_len - n + 1 + j tokens).
# Every token's K and V are written before any row attends (both CPU paths write the step's K/V
# first), so row j reads what a decode step of that token alone would, and gets its result.
MAX_DECODE_ROWS_PER_SEQ = 16


def decode_row_lens(q_len: int, seq_len: int) -> list[int] | None:
    """The lengths each of a sequence's q_len new tokens attends over as decode rows; None where
    they run as a chunk (no token cached before them, or more than MAX_DECODE_ROWS_PER_SEQ)."""
    if not 0 < q_len <= MAX_DECODE_ROWS_PER_SEQ or seq_len <= q_len:
        return None
    return list(range(seq_len - q_len + 1, seq_len + 1))


@dataclass(frozen=True)
class AttentionMetadata:
    """A step's tokens are the requests' new tokens laid end to end.

    Request i contributes query tokens [query_start_loc[i], query_start_loc[i + 1]) which are the
    last query_lens[i] of its seq_lens[i] tokens; its KV lives in the blocks block_tables[i].
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int64, on the device
    # Host copies: the torch backend loops over sequences and must not sync with the device.
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens_host: list[int]  # [num_seqs]
    block_size: int
    # Models with per-request state (vlmserve.attention.state.SequenceState layers; None for the
    # others): each sequence's state slot, and whether its state continues from tokens computed
    # before (num_computed_tokens > 0) or starts from zeros.
    state_slots: torch.Tensor | None = None  # [num_seqs] int64, on the device
    state_slots_host: list[int] | None = None  # [num_seqs]
    has_initial_state: list[bool] | None = None  # [num_seqs]
    # Sequences verifying drafted tokens (speculative decoding): a state layer keeps their state
    # after each of their tokens (SequenceState.position_states), so that the state after the
    # last accepted one can be put back; None: none.
    keep_position_states: list[bool] | None = None  # [num_seqs]
    # query_start_loc on the device, where the caller keeps one (a CUDA graph's persistent buffer).
    query_start_loc_device: torch.Tensor | None = None  # [num_seqs + 1] int32
    # The rows whose hidden states the step uses (sampled and prompt-logprob rows), ascending, where
    # fewer than all and the model prunes (VLModel.prunes_output_rows): its last layer, past
    # attention (which still writes every token's K and V), computes only these, and the forward
    # returns only their hidden states, in this order.
    output_rows: torch.Tensor | None = None  # [num_output_rows] int64, on the device

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    def decode_row_lens(self) -> list[int] | None:
        """Every token's length as a decode row (see decode_row_lens) where every sequence's
        tokens run as decode rows; None otherwise."""
        lens: list[int] = []
        for i, seq_len in enumerate(self.seq_lens_host):
            rows = decode_row_lens(self.query_start_loc[i + 1] - self.query_start_loc[i], seq_len)
            if rows is None:
                return None
            lens += rows
        return lens

    @cached_property
    def query_start_loc_tensor(self) -> torch.Tensor:
        """query_start_loc on the device, int32: copied once per step, on the first layer that
        asks (kernels that locate each sequence's tokens on the device; the torch backend does not)."""
        if self.query_start_loc_device is not None:
            return self.query_start_loc_device
        return torch.tensor(self.query_start_loc, dtype=torch.int32, device=self.seq_lens.device)
