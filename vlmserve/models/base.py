"""The protocol every model family implements; the engine never branches on the family."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.multimodal.inputs import MultiModalItem


class VLModel(nn.Module):
    # Whether forward honours AttentionMetadata.output_rows (then returns only those rows' hidden
    # states): a prompt's other rows need no output projection and MLP in the last layer.
    prunes_output_rows = False

    def embed_multimodal(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Per item, what replaces its placeholder tokens: a [item.length, hidden] tensor, or for a
        family that also injects the item deeper into the decoder (Qwen3-VL's DeepStack) a
        [1 + num_extra_layers, item.length, hidden] stack whose row 0 fills the placeholders and
        whose row 1 + i is added to the hidden states after decoder layer i (see place_multimodal)."""
        raise NotImplementedError

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        layer_extras: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """layer_extras: [num_extra_layers, num_tokens, hidden] from place_multimodal, None when
        no item of the step has per-layer extras. -> [num_tokens, hidden], or with attn.output_rows
        set (a family that prunes) [len(output_rows), hidden]."""
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

    # Whether the model was built with a speculative-decoding draft head of its own (Qwen3.5's
    # multi-token prediction; build_model's draft_head), which draft_forward runs.
    has_draft_head: bool = False

    def draft_forward(
        self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The draft head's output [n, hidden] (compute_logits gives its logits) for n rows laid out
        as a step of the target's: row i pairs the target's hidden state [n, hidden] at positions[:, i]
        ([3, n]) with token_ids[i] [n], the token after it; meta's slot mapping and block tables
        are the target's rows' at those positions (the head's own KV layers write there)."""
        raise NotImplementedError(f"{type(self).__name__} has no draft head")

    def draft_fill(
        self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """What draft_forward writes to the draft head's own KV cache for these rows, without
        computing their output (rows no draft is read from)."""
        raise NotImplementedError(f"{type(self).__name__} has no draft head")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Called once the parameters are allocated, before the weights are loaded."""

    def vision_encoder(self) -> nn.Module | None:
        """The module that encodes images (run only on whole images: many rows at a time)."""
        tower = getattr(self, "visual", None)
        return tower if isinstance(tower, nn.Module) else None


def item_rows(encoded: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Placeholder rows [lo, hi) of an encoder output (either form embed_multimodal returns)."""
    return encoded[lo:hi] if encoded.ndim == 2 else encoded[:, lo:hi]


def place_multimodal(
    inputs_embeds: torch.Tensor, spans: list[tuple[int, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Write each span's rows (item_rows of an encoder output) into `inputs_embeds` [num_tokens,
    hidden] at its row of the batch, and gather the per-layer extras of those that have them into
    [num_extra_layers, num_tokens, hidden] (zero at every other token). No span with extras: None,
    so a family without them pays nothing."""
    num_extra = max((rows.shape[0] - 1 for _, rows in spans if rows.ndim == 3), default=0)
    extras = None
    if num_extra:
        extras = inputs_embeds.new_zeros(num_extra, *inputs_embeds.shape)
    for row, rows in spans:
        if rows.ndim == 2:
            inputs_embeds[row : row + rows.shape[0]] = rows.to(inputs_embeds.dtype)
            continue
        assert rows.shape[0] == num_extra + 1, "every item of a model carries the same number of extras"
        n = rows.shape[1]
        inputs_embeds[row : row + n] = rows[0].to(inputs_embeds.dtype)
        assert extras is not None
        extras[:, row : row + n] = rows[1:].to(extras.dtype)
    return inputs_embeds, extras
