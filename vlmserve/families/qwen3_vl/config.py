"""config.json of Qwen3-VL (Qwen3VLForConditionalGeneration) and Qwen3-VL-MoE
(Qwen3VLMoeForConditionalGeneration), in the published nested layout: the language model under
`text_config` (its rotary settings in `rope_parameters`, or `rope_scaling` as the first uploads
wrote it, with `mrope_section` and `mrope_interleaved`), the vision tower under `vision_config`.
Defaults are transformers' Qwen3VLConfig / Qwen3VLMoeConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlmserve.config import FieldAliases, ModelConfig, VisionConfig, parse_text_config, require
from vlmserve.families.common.config import vision_language_config

QWEN3_VL_ARCHITECTURE = "Qwen3VLForConditionalGeneration"
QWEN3_VL_MOE_ARCHITECTURE = "Qwen3VLMoeForConditionalGeneration"

# The attribute_map of transformers' vision config of Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 (-MoE), 5.23 and 5.24.
VISION_ALIASES = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}
ALIASES = FieldAliases(vision=VISION_ALIASES)
# Qwen3VLMoeTextConfig's attribute_map too: its save_pretrained writes num_experts as num_local_experts
# (5.23 and 5.24; the published checkpoints, written by 4.57, say num_experts).
MOE_ALIASES = FieldAliases(text={"num_local_experts": "num_experts"}, vision=VISION_ALIASES)


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    # Renormalise the top-k routing weights to sum to 1 (transformers 5 always does).
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the experts (else a dense SwiGLU of intermediate_size)."""
        return (
            layer not in self.mlp_only_layers and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class Qwen3VLFamilyConfig:
    """What ModelConfig does not say of a Qwen3-VL (ModelConfig.family_config)."""

    # Vision blocks after which a DeepStack feature is taken; feature k is added to the hidden
    # states after decoder layer k at the image's placeholders.
    deepstack_visual_indexes: tuple[int, ...]
    # Rows of the learned (square) position-embedding grid of the vision tower.
    num_position_embeddings: int
    # M-RoPE frequencies interleaved t, h, w, t, h, w, ... (Qwen3-VL) rather than in three sections.
    mrope_interleaved: bool
    moe: MoeConfig | None = None

    @property
    def num_position_grid(self) -> int:
        return int(self.num_position_embeddings**0.5)


def parse_qwen3_vl_config(raw: dict[str, Any]) -> ModelConfig:
    return _parse(raw, QWEN3_VL_ARCHITECTURE, moe=False)


def parse_qwen3_vl_moe_config(raw: dict[str, Any]) -> ModelConfig:
    return _parse(raw, QWEN3_VL_MOE_ARCHITECTURE, moe=True)


def parse_vision_config(v: dict[str, Any], text_hidden_size: int) -> tuple[VisionConfig, int]:
    """The Qwen3-VL vision tower's config.json section (Qwen3.5 has the same tower), its aliases
    renamed (FieldAliases.vision_section): its VisionConfig and the number of learned position
    embeddings (a square)."""
    vision = VisionConfig(
        depth=int(v.get("depth", 27)),
        embed_dim=int(v.get("hidden_size", 1152)),
        num_heads=int(v.get("num_heads", 16)),
        mlp_ratio=4.0,  # unused: the MLP width is intermediate_size
        hidden_size=int(v.get("out_hidden_size", text_hidden_size)),
        in_channels=int(v.get("in_channels", 3)),
        patch_size=int(v.get("patch_size", 16)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
        rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        intermediate_size=int(v.get("intermediate_size", 4304)),
    )
    if vision.hidden_size != text_hidden_size:
        raise ValueError(
            f"config.json: the vision tower's output width {vision.hidden_size} must equal the language "
            f"model's hidden_size {text_hidden_size}"
        )
    num_positions = int(v.get("num_position_embeddings", 2304))
    if int(num_positions**0.5) ** 2 != num_positions:
        raise ValueError(f"config.json: vision_config.num_position_embeddings {num_positions} must be a square")
    return vision, num_positions


def _parse(raw: dict[str, Any], default_architecture: str, moe: bool) -> ModelConfig:
    aliases = MOE_ALIASES if moe else ALIASES
    text_raw = aliases.text_section(raw)
    text_raw = {"head_dim": 128, **text_raw} if not moe else text_raw  # Qwen3VLTextConfig's default
    text = parse_text_config(text_raw, raw)
    if text.mrope_section is None or len(text.mrope_section) != 3:
        raise ValueError("config.json: text_config.rope_parameters needs an mrope_section of three numbers")
    rope = text_raw.get("rope_parameters") or text_raw.get("rope_scaling") or {}
    v = aliases.vision_section(raw)
    vision, num_positions = parse_vision_config(v, text.hidden_size)
    deepstack = tuple(int(i) for i in v.get("deepstack_visual_indexes", (8, 16, 24)))
    bad = [i for i in deepstack if not 0 <= i < vision.depth]
    if bad or len(set(deepstack)) != len(deepstack):
        raise ValueError(
            f"config.json: vision_config.deepstack_visual_indexes {list(deepstack)} must name distinct blocks "
            f"in 0..{vision.depth - 1}"
        )
    if len(deepstack) > text.num_hidden_layers:
        raise ValueError(
            f"config.json: {len(deepstack)} DeepStack features need as many decoder layers, the model has "
            f"{text.num_hidden_layers}"
        )
    family = Qwen3VLFamilyConfig(
        deepstack_visual_indexes=deepstack,
        num_position_embeddings=num_positions,
        mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
        moe=_parse_moe(text_raw) if moe else None,
    )
    return vision_language_config(
        raw, text_raw, default_architecture, text, vision, family_config=family, mm_embedding_rows=1 + len(deepstack)
    )


def _parse_moe(t: dict[str, Any]) -> MoeConfig:
    config = MoeConfig(
        num_experts=int(require(t, "num_experts", "the text config", MOE_ALIASES.text)),
        num_experts_per_tok=int(require(t, "num_experts_per_tok", "the text config")),
        moe_intermediate_size=int(require(t, "moe_intermediate_size", "the text config")),
        norm_topk_prob=bool(t.get("norm_topk_prob", True)),
        decoder_sparse_step=int(t.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in t.get("mlp_only_layers") or ()),
    )
    if not 0 < config.num_experts_per_tok <= config.num_experts:
        raise ValueError(
            f"config.json: num_experts_per_tok {config.num_experts_per_tok} must be in 1..num_experts "
            f"({config.num_experts})"
        )
    if config.decoder_sparse_step < 1:
        raise ValueError(f"config.json: decoder_sparse_step {config.decoder_sparse_step} must be at least 1")
    return config
