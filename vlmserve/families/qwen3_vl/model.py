"""Qwen3-VL and Qwen3-VL-MoE: the vision tower's merged patches replace the placeholder tokens,
its DeepStack features ride along as per-layer extras (VLModel.embed_multimodal's stacked form),
and a Qwen3 decoder (dense or MoE) with interleaved M-RoPE reads them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from vlmserve.attention import AttentionBackend
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.config import ModelConfig
from vlmserve.families.qwen3_vl.config import Qwen3VLFamilyConfig
from vlmserve.families.qwen3_vl.decoder import Qwen3Model
from vlmserve.families.qwen3_vl.vision import Qwen3VisionTransformer
from vlmserve.models.base import VLModel
from vlmserve.models.loader import WeightTable, load_weights
from vlmserve.models.parallel import ParallelLMHead
from vlmserve.multimodal.inputs import MultiModalItem


class Qwen3VLForConditionalGeneration(VLModel):
    prunes_output_rows = True  # the last layer computes only AttentionMetadata.output_rows

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        family = config.family_config
        assert isinstance(family, Qwen3VLFamilyConfig), "parsed by vlmserve.families.qwen3_vl.config"
        self.config = config
        self.family = family
        self.visual = Qwen3VisionTransformer(
            config.vision, family.deepstack_visual_indexes, family.num_position_embeddings, backend
        )
        self.model = Qwen3Model(config.text, family, backend)
        # Tied checkpoints get their lm_head in tie_weights(), once the embedding is allocated.
        self.lm_head: ParallelLMHead | None = (
            None if config.text.tie_word_embeddings else ParallelLMHead(config.text.hidden_size, config.text.vocab_size)
        )

    def tie_weights(self) -> None:
        if self.config.text.tie_word_embeddings:
            self.lm_head = ParallelLMHead.tied_to(self.model.embed_tokens)

    # -- the model protocol -------------------------------------------------------------------

    def embed_multimodal(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Encode the items in one vision pass; per item [1 + num_deepstack, item.length, hidden]:
        row 0 fills its placeholders, row 1 + k is added after decoder layer k."""
        if not items:
            return []
        device = self.model.embed_tokens.weight.device
        pixel_values = torch.cat([item.pixel_values for item in items]).to(device, non_blocking=True)
        stacked = self.visual(pixel_values, [item.grid_thw for item in items])
        return list(stacked.split([item.length for item in items], dim=1))

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
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = self.get_input_embeddings(input_ids)
        if layer_extras is not None:
            assert layer_extras.shape[1:] == inputs_embeds.shape, "extras are per batch row"
            assert layer_extras.shape[0] <= len(self.family.deepstack_visual_indexes)
        return self.model(inputs_embeds, positions, attn, layer_extras)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "tie_weights() runs when the model is built"
        return self.lm_head(hidden)

    # -- weights --------------------------------------------------------------------------------

    def weight_table(self) -> WeightTable:
        """Checkpoint names to ours; where each part of a fused parameter goes (and the rank's
        slice of it) is the parameter's ShardSpec (models/parallel.py), not this table's."""
        text = self.config.text
        embed_dim = self.config.vision.embed_dim
        reshape: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "visual.patch_embed.proj.weight": lambda w: w.reshape(embed_dim, -1)
        }
        moe = self.family.moe
        # Experts stacked per layer: [expert, in, out] as published (transformers 4.57), [expert, out,
        # in] as transformers 5 saves them and as held here; models/expert_layout.py tells which.
        stacked = frozenset(
            f"model.layers.{layer}.mlp.experts.{name}"
            for layer in range(text.num_hidden_layers)
            if moe is not None and moe.is_sparse(layer)
            for name in ("gate_up_proj", "down_proj")
        )
        return WeightTable(
            # transformers 5 (and the published checkpoints) save model.language_model.* and model.visual.*
            renames=(("model.language_model.", "model."), ("model.visual.", "visual.")),
            packed={
                "q_proj": ("qkv_proj", "q"),
                "k_proj": ("qkv_proj", "k"),
                "v_proj": ("qkv_proj", "v"),
                "gate_proj": ("gate_up_proj", "0"),
                "up_proj": ("gate_up_proj", "1"),
            },
            reshape=reshape,
            ignore=lambda name: (
                name.endswith("rotary_emb.inv_freq") or (self.lm_head is None and name == "lm_head.weight")
            ),
            either_layout=stacked,
            transformers_version=self.config.transformers_version,
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self, weights, self.weight_table())


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """The same model with MoE decoder layers (config.family_config.moe)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        assert isinstance(config.family_config, Qwen3VLFamilyConfig) and config.family_config.moe is not None
        super().__init__(config, backend)
