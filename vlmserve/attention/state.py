"""Per-request state of fixed size, the second kind of sequence memory beside the paged KV cache.

A linear-attention layer (Gated DeltaNet) keeps no KV per token: each request carries a short
convolution window and a recurrent state whose sizes do not grow with the sequence. A layer that
needs such state owns a SequenceState and declares its shapes; the engine allocates one row per
state slot of each ([num_slots, *shape]), binds them here, and tells the layer each sequence's
slot through AttentionMetadata.state_slots. A model without SequenceState layers gets no pool
and no per-step work."""

from __future__ import annotations

import torch
from torch import nn


class SequenceState(nn.Module):
    def __init__(self, shapes: list[tuple[tuple[int, ...], torch.dtype | None]]) -> None:
        """shapes: per state tensor, one slot's shape and its dtype (None: the model's dtype)."""
        super().__init__()
        self.shapes = shapes
        # Bound by the engine: per state tensor [num_slots, *shape].
        self.states: list[torch.Tensor] = []
        # The last step's states after each token of the sequences it was asked to keep them for
        # (AttentionMetadata.keep_position_states): slot -> per state tensor [tokens, *shape].
        self.position_states: dict[int, list[torch.Tensor]] = {}

    def slot_bytes(self, model_dtype: torch.dtype) -> int:
        total = 0
        for shape, dtype in self.shapes:
            numel = 1
            for n in shape:
                numel *= n
            total += numel * torch.empty((), dtype=dtype or model_dtype).element_size()
        return total

    def bind(self, num_slots: int, model_dtype: torch.dtype, device: torch.device) -> None:
        self.states = [
            torch.zeros(num_slots, *shape, dtype=dtype or model_dtype, device=device) for shape, dtype in self.shapes
        ]

    def reset(self, slots: list[int]) -> None:
        """Zero the given slots: a sequence starting from no state."""
        if slots:
            index = torch.tensor(slots, dtype=torch.long, device=self.states[0].device)
            for state in self.states:
                state.index_fill_(0, index, 0)
