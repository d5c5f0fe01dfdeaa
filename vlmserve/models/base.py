"""The protocol every model family implements; the engine never branches on the family."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.multimodal.inputs import MultiModalItem


class VLModel(nn.Module):
    def embed_multimodal(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """One [item.length, hidden] tensor per item: what replaces its placeholder tokens."""
        raise NotImplementedError

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Called once the parameters are allocated, before the weights are loaded."""
