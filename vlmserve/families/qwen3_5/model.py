"""Qwen3.5 and Qwen3.5-MoE: Qwen3-VL's vision tower (without DeepStack) fills the placeholder
tokens, and the hybrid decoder (decoder.py) reads them."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vlmserve.attention import AttentionBackend
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.config import ModelConfig
from vlmserve.families.qwen3_5.config import Qwen35FamilyConfig
from vlmserve.families.qwen3_5.decoder import Qwen35Model
from vlmserve.families.qwen3_vl.vision import Qwen3VisionTransformer
from vlmserve.models.base import VLModel
from vlmserve.models.layers import Linear
from vlmserve.models.loader import WeightTable, load_weights
from vlmserve.models.parallel import refuse_tensor_parallel
from vlmserve.multimodal.inputs import MultiModalItem


class Qwen35ForConditionalGeneration(VLModel):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        # NOTE: its Gated DeltaNet layers and their per-request state are not sharded.
        refuse_tensor_parallel("Qwen3.5 (hybrid Gated DeltaNet)")
        super().__init__()
        family = config.family_config
        assert isinstance(family, Qwen35FamilyConfig), "parsed by vlmserve.families.qwen3_5.config"
        self.config = config
        self.family = family
        self.visual = Qwen3VisionTransformer(config.vision, (), family.num_position_embeddings, backend)
        self.model = Qwen35Model(config.text, family, backend)
        self.lm_head: Linear | None = (
            None
            if config.text.tie_word_embeddings
            else Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        )

    def tie_weights(self) -> None:
        if self.config.text.tie_word_embeddings:
            embed = self.model.embed_tokens.weight
            self.lm_head = Linear(embed.shape[1], embed.shape[0], bias=False, device="meta")
            self.lm_head.weight = embed

    # -- the model protocol -------------------------------------------------------------------

    def embed_multimodal(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """Encode the items in one vision pass; per item [item.length, hidden]."""
        if not items:
            return []
        device = self.model.embed_tokens.weight.device
        pixel_values = torch.cat([item.pixel_values for item in items]).to(device, non_blocking=True)
        merged = self.visual(pixel_values, [item.grid_thw for item in items])[0]  # no DeepStack rows
        return list(merged.split([item.length for item in items]))

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
        assert layer_extras is None, "Qwen3.5's encoder outputs carry no per-layer extras"
        if inputs_embeds is None:
            assert input_ids is not None
            inputs_embeds = self.get_input_embeddings(input_ids)
        return self.model(inputs_embeds, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "tie_weights() runs when the model is built"
        return self.lm_head(hidden)

    # -- weights --------------------------------------------------------------------------------

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
        embed_dim = self.config.vision.embed_dim
        return WeightTable(
            renames=(("model.language_model.", "model."), ("model.visual.", "visual.")),
            packed={
                "q_proj": ("qkv_proj", "q"),
                "k_proj": ("qkv_proj", "k"),
                "v_proj": ("qkv_proj", "v"),
                "gate_proj": ("gate_up_proj", "0"),
                "up_proj": ("gate_up_proj", "1"),
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
            reshape={"visual.patch_embed.proj.weight": lambda w: w.reshape(embed_dim, -1)},
            # The published checkpoints carry a multi-token-prediction head (mtp.*) vlmserve does not run.
            ignore=lambda name: (
                name.startswith("mtp.")
                or name.endswith("rotary_emb.inv_freq")
                or (self.lm_head is None and name == "lm_head.weight")
            ),
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_weights(self, weights, self.weight_table())


class Qwen35MoeForConditionalGeneration(Qwen35ForConditionalGeneration):
    """The same model with a routed mixture of experts and a shared expert in every layer."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        assert isinstance(config.family_config, Qwen35FamilyConfig) and config.family_config.moe is not None
        super().__init__(config, backend)
