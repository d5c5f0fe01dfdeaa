"""Qwen2-VL: the vision tower's merged patch embeddings replace the <|image_pad|> tokens of a
Qwen2 decoder with M-RoPE."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.config import ModelConfig
from vlmserve.families.qwen2_vl.decoder import Qwen2Model
from vlmserve.families.qwen2_vl.vision import Qwen2VisionTransformer
from vlmserve.models.base import VLModel
from vlmserve.models.loader import WeightTable, load_weights
from vlmserve.models.parallel import ParallelLMHead
from vlmserve.multimodal.inputs import MultiModalItem


class Qwen2VLForConditionalGeneration(VLModel):
    prunes_output_rows = True  # the last layer computes only AttentionMetadata.output_rows
    # Built from (config.vision, backend); maps (pixel_values, grid_thw) to the merged embeddings.
    # Qwen2.5-VL swaps in its windowed tower.
    vision_tower: ClassVar[type[nn.Module]] = Qwen2VisionTransformer

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.visual = self.vision_tower(config.vision, backend)
        self.model = Qwen2Model(config.text, backend)
        # Tied checkpoints get their lm_head in tie_weights(), once the embedding is allocated.
        self.lm_head: ParallelLMHead | None = (
            None if config.text.tie_word_embeddings else ParallelLMHead(config.text.hidden_size, config.text.vocab_size)
        )

    def tie_weights(self) -> None:
        """Share the embedding matrix as lm_head (called after the weights are allocated:
        sharing set up on the meta device would not survive allocation)."""
        if self.config.text.tie_word_embeddings:
            self.lm_head = ParallelLMHead.tied_to(self.model.embed_tokens)

    # -- the model protocol -------------------------------------------------------------------

    def embed_multimodal(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Encode the items in one vision pass; one [item.length, hidden] tensor per item."""
        if not items:
            return []
        device = self.model.embed_tokens.weight.device
        pixel_values = torch.cat([item.pixel_values for item in items]).to(device, non_blocking=True)
        embeds = self.visual(pixel_values, [item.grid_thw for item in items])
        return list(embeds.split([item.length for item in items]))

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

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
        assert layer_extras is None, "this family's items carry no per-layer extras"
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = self.get_input_embeddings(input_ids)
        return self.model(inputs_embeds, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "tie_weights() runs when the model is built"
        return self.lm_head(hidden)

    # -- weights --------------------------------------------------------------------------------

    def weight_table(self) -> WeightTable:
        """Checkpoint names to ours; where each part of a fused parameter goes (and the rank's
        slice of it) is the parameter's ShardSpec (models/parallel.py), not this table's."""
        embed_dim = self.config.vision.embed_dim
        return WeightTable(
            # transformers 5 saves model.language_model.* and model.visual.*; 4.x model.* and visual.*
            renames=(("model.language_model.", "model."), ("model.visual.", "visual.")),
            packed={
                "q_proj": ("qkv_proj", "q"),
                "k_proj": ("qkv_proj", "k"),
                "v_proj": ("qkv_proj", "v"),
                "gate_proj": ("gate_up_proj", "0"),
                "up_proj": ("gate_up_proj", "1"),
            },
            reshape={"visual.patch_embed.proj.weight": lambda w: w.reshape(embed_dim, -1)},
            ignore=lambda name: (
                name.endswith("rotary_emb.inv_freq") or (self.lm_head is None and name == "lm_head.weight")
            ),
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self, weights, self.weight_table())
