"""Qwen3.5 and Qwen3.5-MoE: Qwen3-VL's vision tower (without DeepStack) fills the placeholder
tokens, and the hybrid decoder (decoder.py) reads them."""

from __future__ import annotations

import dataclasses

import torch

from vlmserve.attention import AttentionBackend
from vlmserve.config import ModelConfig
from vlmserve.families.common.model import VisionLanguageModel, untied_lm_head
from vlmserve.families.qwen3_5.config import Qwen35FamilyConfig
from vlmserve.families.qwen3_5.decoder import Qwen35Model
from vlmserve.families.qwen3_vl.vision import Qwen3VisionTransformer
from vlmserve.models.loader import WeightTable
from vlmserve.models.parallel import refuse_tensor_parallel
from vlmserve.multimodal.inputs import MultiModalItem


class Qwen35ForConditionalGeneration(VisionLanguageModel):
    display_name = "Qwen3.5"  # what a refusal calls it

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        # NOTE: its Gated DeltaNet layers and their per-request state are not sharded.
        refuse_tensor_parallel(f"{self.display_name} (hybrid Gated DeltaNet)")
        super().__init__(config)
        family = config.family_config
        assert isinstance(family, Qwen35FamilyConfig), "parsed by vlmserve.families.qwen3_5.config"
        self.family = family
        self.visual = Qwen3VisionTransformer(config.vision, (), family.num_position_embeddings, backend)
        self.model = Qwen35Model(config.text, family, backend)
        self.lm_head = untied_lm_head(config.text)

    def encode(self, items: list[MultiModalItem], device: torch.device) -> torch.Tensor:
        """[total length, hidden]: the tower's merged row (it has no DeepStack rows)."""
        return super().encode(items, device)[0]

    def weight_table(self) -> WeightTable:
        text, f = self.config.text, self.family
        q_size = text.num_attention_heads * text.head_dim
        kv_size = text.num_key_value_heads * text.head_dim
        i = text.intermediate_size  # the dense MLP's width, or the MoE model's shared expert's
        moe = f.moe
        e_i = 0 if moe is None else moe.moe_intermediate_size
        offsets = {
            # Full attention: per head [query | gate], as published in q_proj.
            ("qkv_proj", "q"): (0, 2 * q_size),
            ("qkv_proj", "k"): (2 * q_size, kv_size),
            ("qkv_proj", "v"): (2 * q_size + kv_size, kv_size),
            ("gate_up_proj", "0"): (0, i),
            ("gate_up_proj", "1"): (i, i),
            ("in_proj", "qkv"): (0, f.conv_dim),
            ("in_proj", "z"): (f.conv_dim, f.value_dim),
            ("in_proj", "b"): (f.conv_dim + f.value_dim, f.num_v_heads),
            ("in_proj", "a"): (f.conv_dim + f.value_dim + f.num_v_heads, f.num_v_heads),
            # One routed expert's row of experts.gate_up_proj [experts, gate | up, hidden].
            ("experts", "gate"): (0, e_i),
            ("experts", "up"): (e_i, e_i),
        }
        common = super().weight_table()
        return dataclasses.replace(
            common,
            packed={
                **common.packed,
                "in_proj_qkv": ("in_proj", "qkv"),
                "in_proj_z": ("in_proj", "z"),
                "in_proj_b": ("in_proj", "b"),
                "in_proj_a": ("in_proj", "a"),
            },
            shards=lambda param, shard: offsets[(param.rsplit(".", 2)[-2], shard)],
            # The MoE model's experts as published (and as transformers saves them): one by one,
            # experts.<e>.gate_proj / up_proj / down_proj, stacked here per layer.
            experts={
                "gate_proj": ("gate_up_proj", "gate"),
                "up_proj": ("gate_up_proj", "up"),
                "down_proj": ("down_proj", None),
            },
            # The published checkpoints carry a multi-token-prediction head (mtp.*) vlmserve does not run.
            ignore=lambda name: name.startswith("mtp.") or self.ignores_weight(name),
        )


class Qwen35MoeForConditionalGeneration(Qwen35ForConditionalGeneration):
    """The same model with a routed mixture of experts and a shared expert in every layer."""

    display_name = "Qwen3.5-MoE"

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        assert isinstance(config.family_config, Qwen35FamilyConfig) and config.family_config.moe is not None
        super().__init__(config, backend)
