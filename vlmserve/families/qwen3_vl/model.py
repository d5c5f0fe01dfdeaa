"""Qwen3-VL and Qwen3-VL-MoE: the vision tower's merged patches replace the placeholder tokens,
its DeepStack features ride along as per-layer extras (VLModel.embed_multimodal's stacked form),
and a Qwen3 decoder (dense or MoE) with interleaved M-RoPE reads them."""

from __future__ import annotations

import dataclasses

from vlmserve.attention import AttentionBackend
from vlmserve.config import ModelConfig
from vlmserve.families.common.model import VisionLanguageModel, untied_lm_head
from vlmserve.families.qwen3_vl.config import Qwen3VLFamilyConfig
from vlmserve.families.qwen3_vl.decoder import qwen3_decoder
from vlmserve.families.qwen3_vl.vision import Qwen3VisionTransformer
from vlmserve.models.loader import WeightTable


class Qwen3VLForConditionalGeneration(VisionLanguageModel):
    prunes_output_rows = True  # the last layer computes only AttentionMetadata.output_rows

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(config)
        family = config.family_config
        assert isinstance(family, Qwen3VLFamilyConfig), "parsed by vlmserve.families.qwen3_vl.config"
        self.family = family
        # Its items: [1 + num_deepstack, length, hidden], row 1 + k added after decoder layer k.
        self.num_layer_extras = len(family.deepstack_visual_indexes)
        self.visual = Qwen3VisionTransformer(
            config.vision, family.deepstack_visual_indexes, family.num_position_embeddings, backend
        )
        self.model = qwen3_decoder(config.text, family, backend)
        self.lm_head = untied_lm_head(config.text)

    def weight_table(self) -> WeightTable:
        moe = self.family.moe
        # Experts stacked per layer: [expert, in, out] as published (transformers 4.57), [expert, out,
        # in] as transformers 5 saves them and as held here; models/expert_layout.py tells which.
        stacked = frozenset(
            f"model.layers.{layer}.mlp.experts.{name}"
            for layer in range(self.config.text.num_hidden_layers)
            if moe is not None and moe.is_sparse(layer)
            for name in ("gate_up_proj", "down_proj")
        )
        return dataclasses.replace(
            super().weight_table(), either_layout=stacked, transformers_version=self.config.transformers_version
        )


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """The same model with MoE decoder layers (config.family_config.moe)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        assert isinstance(config.family_config, Qwen3VLFamilyConfig) and config.family_config.moe is not None
        super().__init__(config, backend)
