"""Attention metadata: built by the model runner each step and passed down as an argument."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


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

    @cached_property
    def query_start_loc_tensor(self) -> torch.Tensor:
        """query_start_loc on the device, int32: copied once per step, on the first layer that
        asks (kernels that locate each sequence's tokens on the device; the torch backend does not)."""
        if self.query_start_loc_device is not None:
            return self.query_start_loc_device
        return torch.tensor(self.query_start_loc, dtype=torch.int32, device=self.seq_lens.device)
