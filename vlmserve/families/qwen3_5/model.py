"""Qwen3.5 and Qwen3.5-MoE: Qwen3-VL's vision tower (without DeepStack) fills the placeholder
tokens, and the hybrid decoder (decoder.py) reads them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch

from vlmserve.attention import AttentionBackend
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.config import ModelConfig
from vlmserve.families.common.model import VisionLanguageModel, untied_lm_head
from vlmserve.families.qwen3_5.config import Qwen35FamilyConfig
from vlmserve.families.qwen3_5.decoder import Qwen35Model
from vlmserve.families.qwen3_5.mtp import Qwen35MultiTokenPredictor
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
        # The multi-token-prediction head (mtp.py): built only when asked, for its KV cache.
        self.mtp = Qwen35MultiTokenPredictor(config.text, family, backend) if config.draft_head else None
        self.has_draft_head = self.mtp is not None

    def draft_forward(
        self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The MTP head's output [n, hidden] (compute_logits turns it into logits): row i takes
        token_ids[i] [n] (the token after the one hidden[i] [n, hidden] was computed at) and runs
        at positions[:, i] ([3, n], the hidden state's position) with meta's slot and blocks."""
        if self.mtp is None:
            raise NotImplementedError(f"{self.display_name} was built without its multi-token-prediction head")
        cos, sin = self.model.rotary(positions, hidden.dtype)  # the decoder's M-RoPE
        return self.mtp(self.get_input_embeddings(token_ids), hidden, cos, sin, meta)

    def draft_fill(
        self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """draft_forward's writes to the head's KV cache alone (rows whose output no draft reads)."""
        if self.mtp is None:
            raise NotImplementedError(f"{self.display_name} was built without its multi-token-prediction head")
        cos, sin = self.model.rotary(positions, hidden.dtype)
        self.mtp.fill(self.get_input_embeddings(token_ids), hidden, cos, sin, meta)

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
            # The published checkpoints carry a multi-token-prediction head (mtp.*), loaded where
            # it was built (mtp.py names its tensors) and ignored otherwise.
            ignore=lambda name: (self.mtp is None and name.startswith("mtp.")) or self.ignores_weight(name),
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As every family's; a head asked for of a checkpoint without one is refused by name."""
        head_names: list[str] = []  # the checkpoint's mtp.* tensors

        def seen(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("mtp."):
                    head_names.append(name)
                yield name, tensor

        try:
            super().load_weights(seen(weights))
        except ValueError:
            if self.mtp is not None and not head_names:
                raise ValueError(
                    f"the checkpoint has no multi-token-prediction head (no mtp.* weights, though its "
                    f"config.json says text_config.mtp_num_hidden_layers {self.family.mtp_num_hidden_layers}): "
                    "speculative decoding with method 'mtp' needs a checkpoint that ships it"
                ) from None
            raise


class Qwen35MoeForConditionalGeneration(Qwen35ForConditionalGeneration):
    """The same model with a routed mixture of experts and a shared expert in every layer."""

    display_name = "Qwen3.5-MoE"

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        assert isinstance(config.family_config, Qwen35FamilyConfig) and config.family_config.moe is not None
        super().__init__(config, backend)
