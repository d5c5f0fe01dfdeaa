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

    @staticmethod
    def decode_positions(start: int, end: int, mrope_delta: int, num_prompt_tokens: int) -> torch.Tensor:
        """[3, end - start] positions of tokens [start, end) past the prompt (generated tokens,
        0-based over the whole sequence). M-RoPE: all three rows advance together, offset by the
        prompt's mrope_delta. A family with another rule overrides this."""
        del num_prompt_tokens
        return torch.arange(start + mrope_delta, end + mrope_delta).expand(3, -1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Called once the parameters are allocated, before the weights are loaded."""
