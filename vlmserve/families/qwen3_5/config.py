"""config.json of Qwen3.5 (Qwen3_5ForConditionalGeneration), in the published nested layout: the
language model under `text_config` with `layer_types` (or `full_attention_interval`), the
`linear_*` sizes of its Gated DeltaNet layers, and `rope_parameters` holding mrope_section (over
the rotary part of a head: head_dim * partial_rotary_factor / 2 frequencies), mrope_interleaved
and partial_rotary_factor; the vision tower under `vision_config` (Qwen3-VL's, no DeepStack).
Qwen3.5-MoE (Qwen3_5MoeForConditionalGeneration) adds num_experts, num_experts_per_tok,
moe_intermediate_size and shared_expert_intermediate_size: every layer's MLP is a routed mixture
(top-k of a softmax, renormalised) plus one shared expert. text_config.mtp_num_hidden_layers
(1 in the published checkpoints; transformers' config does not name it) gives the layers of the
multi-token-prediction head (mtp.py). Defaults are transformers' Qwen3_5Config / Qwen3_5MoeConfig."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vlmserve.config import FieldAliases, ModelConfig, parse_text_config, require
from vlmserve.families.common.config import vision_language_config
from vlmserve.families.qwen3_vl.config import VISION_ALIASES, MoeConfig, parse_vision_config

QWEN3_5_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
QWEN3_5_MOE_ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
LAYER_TYPES = ("linear_attention", "full_attention")
# The vision tokens' ids in the published Qwen3.5 vocabulary, where config.json does not name them.
TOKEN_IDS = {
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
}
# transformers' Qwen3_5VisionConfig / Qwen3_5MoeVisionConfig attribute_map (5.23 and 5.24); their text
# configs have none (Qwen3.5-MoE's writes num_experts as it is).
ALIASES = FieldAliases(vision=VISION_ALIASES)


@dataclass(frozen=True)
class Qwen35FamilyConfig:
    """What ModelConfig does not say of a Qwen3.5 (ModelConfig.family_config)."""

    layer_types: tuple[str, ...]  # per decoder layer: "linear_attention" or "full_attention"
    # Gated DeltaNet: a depthwise causal conv of this many taps over q, k and v, then num_k_heads
    # query/key heads of key_head_dim, each serving num_v_heads / num_k_heads value heads.
    conv_kernel_dim: int
    key_head_dim: int
    value_head_dim: int
    num_k_heads: int
    num_v_heads: int
    # Full attention: the first rotary_dim of each head's head_dim dimensions are rotated.
    rotary_dim: int
    num_position_embeddings: int
    mrope_interleaved: bool
    # The MoE model: every layer's routed experts (Qwen3-VL-MoE's), and the width of the shared
    # expert beside them (its output scaled by a sigmoid gate per token).
    moe: MoeConfig | None = None
    shared_expert_intermediate_size: int = 0
    # Decoder layers of the multi-token-prediction head the checkpoint ships (mtp.*; the published
    # Qwen3.5 and Qwen3.5-MoE: 1, text_config.mtp_num_hidden_layers); 0 where it names none.
    mtp_num_hidden_layers: int = 0

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


def parse_qwen3_5_config(raw: dict[str, Any]) -> ModelConfig:
    return _parse(raw, QWEN3_5_ARCHITECTURE, moe=False)


def parse_qwen3_5_moe_config(raw: dict[str, Any]) -> ModelConfig:
    return _parse(raw, QWEN3_5_MOE_ARCHITECTURE, moe=True)


def _parse(raw: dict[str, Any], default_architecture: str, moe: bool) -> ModelConfig:
    text_raw = ALIASES.text_section(raw)
    moe_config = _parse_moe(text_raw) if moe else None
    shared_width = int(text_raw.get("shared_expert_intermediate_size", 512)) if moe else 0
    rope = dict(text_raw.get("rope_parameters") or text_raw.get("rope_scaling") or {})
    head_dim = int(text_raw.get("head_dim", 256))
    factor = float(rope.get("partial_rotary_factor", text_raw.get("partial_rotary_factor", 0.25)))
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(
            f"config.json: partial_rotary_factor {factor} of head_dim {head_dim} must give an even rotary width"
        )
    section = tuple(int(n) for n in rope.get("mrope_section", (11, 11, 10)))
    if len(section) != 3 or 2 * sum(section) != rotary_dim:
        raise ValueError(
            f"config.json: mrope_section {list(section)} must be three numbers summing to the rotary half-width "
            f"{rotary_dim // 2} (head_dim {head_dim} x partial_rotary_factor {factor} / 2)"
        )
    # parse_text_config checks mrope_section against the whole head: give it none, set ours after.
    rope_without_section = {k: v for k, v in rope.items() if k != "mrope_section"}
    text_fields = {**text_raw, "head_dim": head_dim, "rope_parameters": rope_without_section}
    text_fields.setdefault("max_position_embeddings", 32768)
    if moe:
        # NOTE: the MoE model has no dense MLP; intermediate_size says the shared expert's width.
        text_fields["intermediate_size"] = shared_width
    text_fields.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    text = dataclasses.replace(parse_text_config(text_fields, raw), mrope_section=section)
    num_layers = text.num_hidden_layers
    layer_types = text_raw.get("layer_types")
    if layer_types is None:
        interval = int(text_raw.get("full_attention_interval", 4))
        if interval < 1:
            raise ValueError(f"config.json: full_attention_interval {interval} must be at least 1")
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    layer_types = tuple(layer_types)
    bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if bad or len(layer_types) != num_layers:
        raise ValueError(
            f"config.json: text_config.layer_types must name {num_layers} layers, each one of {list(LAYER_TYPES)}; "
            f"got {len(layer_types)}{f' with {bad}' if bad else ''}"
        )
    vision, num_positions = parse_vision_config(ALIASES.vision_section(raw), text.hidden_size)
    family = Qwen35FamilyConfig(
        layer_types=layer_types,
        conv_kernel_dim=int(text_raw.get("linear_conv_kernel_dim", 4)),
        key_head_dim=int(text_raw.get("linear_key_head_dim", 128)),
        value_head_dim=int(text_raw.get("linear_value_head_dim", 128)),
        num_k_heads=int(text_raw.get("linear_num_key_heads", 16)),
        num_v_heads=int(text_raw.get("linear_num_value_heads", 32)),
        rotary_dim=rotary_dim,
        num_position_embeddings=num_positions,
        mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
        moe=moe_config,
        shared_expert_intermediate_size=shared_width,
        mtp_num_hidden_layers=int(text_raw.get("mtp_num_hidden_layers", 0)),
    )
    if family.mtp_num_hidden_layers < 0:
        raise ValueError(
            f"config.json: text_config.mtp_num_hidden_layers {family.mtp_num_hidden_layers} must be at least 0"
        )
    if family.num_v_heads % family.num_k_heads:
        raise ValueError(
            f"config.json: linear_num_value_heads {family.num_v_heads} must be a multiple of "
            f"linear_num_key_heads {family.num_k_heads}"
        )
    if family.conv_kernel_dim < 2:
        raise ValueError(f"config.json: linear_conv_kernel_dim {family.conv_kernel_dim} must be at least 2")
    return vision_language_config(raw, text_raw, default_architecture, text, vision, TOKEN_IDS, family_config=family)


def _parse_moe(t: dict[str, Any]) -> MoeConfig:
    """Qwen3.5-MoE routes every layer and always renormalises its top-k weights."""
    config = MoeConfig(
        num_experts=int(require(t, "num_experts", "the text config")),
        num_experts_per_tok=int(require(t, "num_experts_per_tok", "the text config")),
        moe_intermediate_size=int(require(t, "moe_intermediate_size", "the text config")),
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
    )
    if not 0 < config.num_experts_per_tok <= config.num_experts:
        raise ValueError(
            f"config.json: num_experts_per_tok {config.num_experts_per_tok} must be in 1..num_experts "
            f"({config.num_experts})"
        )
    return config
