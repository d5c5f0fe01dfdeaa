"""The model protocol (vlmserve.models.base.VLModel) for a family built the Qwen way: a vision tower
whose outputs fill the placeholder tokens, a decoder, and an lm_head over the decoder's output
(tied to the token embedding or not). A family builds its parts under the checkpoint's module
names and says where they are; encoding, embedding, the forward, the logits and the weight
table's common entries are the same for all of them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.config import ModelConfig, TextConfig
from vlmserve.models.base import VLModel
from vlmserve.models.loader import WeightTable, load_weights
from vlmserve.models.parallel import ParallelLMHead, VocabParallelEmbedding
from vlmserve.multimodal.inputs import MultiModalItem

# transformers 5 (and the published Qwen3-VL and Qwen3.5 checkpoints) save model.language_model.*
# and model.visual.*; 4.x saved Qwen2-VL and Qwen2.5-VL as model.* and visual.*: ours.
RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))
# The checkpoint's q/k/v and gate/up projections, each fused into one matmul here.
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "0"),
    "up_proj": ("gate_up_proj", "1"),
}


def untied_lm_head(text: TextConfig) -> ParallelLMHead | None:
    """The lm_head of an untied checkpoint; None for a tied one (VisionLanguageModel.tie_weights
    makes it once the embedding is allocated)."""
    return None if text.tie_word_embeddings else ParallelLMHead(text.hidden_size, text.vocab_size)


class VisionLanguageModel(VLModel):
    """A family's model sets `config` (super().__init__), builds its vision tower and decoder, and
    sets `lm_head = untied_lm_head(config.text)`. By default the decoder is `self.model` (with its
    `embed_tokens`) and the tower `self.visual`, called as visual(pixel_values, grid_thw)."""

    # Rows of per-layer extras an item may carry after its placeholder row (Qwen3-VL's DeepStack
    # features: embed_multimodal's stacked form); 0 for a family without them.
    num_layer_extras = 0

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.lm_head: ParallelLMHead | None = None

    # -- where the parts are ----------------------------------------------------------------------

    @property
    def decoder(self) -> nn.Module:
        """forward(inputs_embeds [num_tokens, hidden], positions, attn[, layer_extras]) -> hidden."""
        return cast("nn.Module", self.model)

    @property
    def token_embedding(self) -> VocabParallelEmbedding:
        return cast("VocabParallelEmbedding", self.decoder.embed_tokens)

    def encode(self, items: list[MultiModalItem], device: torch.device) -> torch.Tensor:
        """The items in one vision pass: [total length, hidden], or stacked with their per-layer
        extras [1 + num_layer_extras, total length, hidden] (the items' rows in order)."""
        pixel_values = torch.cat([item.pixel_values for item in items]).to(device, non_blocking=True)
        visual = cast("nn.Module", self.visual)
        return cast("torch.Tensor", visual(pixel_values, [item.grid_thw for item in items]))

    # -- the model protocol -------------------------------------------------------------------

    def tie_weights(self) -> None:
        """Share the embedding matrix as lm_head (called after the weights are allocated:
        sharing set up on the meta device would not survive allocation)."""
        if self.config.text.tie_word_embeddings:
            self.lm_head = ParallelLMHead.tied_to(self.token_embedding)

    def embed_multimodal(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Encode the items in one pass; per item [item.length, hidden], or for a family with
        per-layer extras [1 + num_layer_extras, item.length, hidden] (row 0 fills its
        placeholders, row 1 + k is added after decoder layer k)."""
        if not items:
            return []
        encoded = self.encode(items, self.token_embedding.weight.device)
        return list(encoded.split([item.length for item in items], dim=-2))

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.token_embedding(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        layer_extras: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [num_tokens] (or inputs_embeds [num_tokens, hidden]), positions
        [3, num_tokens] -> hidden states [num_tokens, hidden]."""
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = self.get_input_embeddings(input_ids)
        if layer_extras is None:
            return self.decoder(inputs_embeds, positions, attn)
        assert self.num_layer_extras, "this family's items carry no per-layer extras"
        assert layer_extras.shape[1:] == inputs_embeds.shape, "extras are per batch row"
        assert layer_extras.shape[0] <= self.num_layer_extras
        return self.decoder(inputs_embeds, positions, attn, layer_extras)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "tie_weights() runs when the model is built"
        return self.lm_head(hidden)

    # -- weights --------------------------------------------------------------------------------

    def weight_table(self) -> WeightTable:
        """Checkpoint names to ours; where each part of a fused parameter goes (and the rank's
        slice of it) is the parameter's ShardSpec (models/parallel.py), not this table's. A
        family's own entries: dataclasses.replace of this table."""
        embed_dim = self.config.vision.embed_dim
        return WeightTable(
            renames=RENAMES,
            packed=dict(FUSED_PROJECTIONS),
            reshape={"visual.patch_embed.proj.weight": lambda w: w.reshape(embed_dim, -1)},
            ignore=self.ignores_weight,
        )

    def ignores_weight(self, name: str) -> bool:
        """Checkpoint tensors no parameter takes: rotary buffers some exports carry, and a tied
        checkpoint's lm_head."""
        return name.endswith("rotary_emb.inv_freq") or (self.lm_head is None and name == "lm_head.weight")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self, weights, self.weight_table())
