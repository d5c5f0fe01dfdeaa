"""config.json of Qwen-VL-Chat (QWenConfig of its remote code, fields flat at the top level, model_type
"qwen"): kv_channels, rotary_emb_base, layer_norm_epsilon and a "visual" dict. It parses into the
family-neutral TextConfig and VisionConfig plus a QwenVLConfig holding what only this family has
(dynamic NTK, logn attention, the Resampler's sizes), kept as ModelConfig.family_config."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vlmserve.config import ModelConfig, TextConfig, VisionConfig, checkpoint_dtype, require, transformers_version

QWEN_VL_ARCHITECTURE = "QWenLMHeadModel"


@dataclass(frozen=True)
class QwenVisualConfig:
    """Qwen-VL-Chat's `visual` dict: a 448 px ViT (conv patches, learned positional embedding,
    pre-LayerNorm blocks) and a Resampler of n_queries learned queries."""

    image_size: int
    patch_size: int
    width: int
    layers: int
    heads: int
    mlp_ratio: float
    output_dim: int
    image_start_id: int
    # Fixed in the reference code (VisionTransformer's default, not in config.json): 256 = 16 x 16
    # queries, and the ViT's learned positional embedding has 256 rows too.
    n_queries: int = 256

    @property
    def grid_size(self) -> int:
        """Patches per side: 448 / 14 = 32, so 1024 patches per image."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid_size**2

    @property
    def mlp_width(self) -> int:
        """int(1664 * 4.9231) = 8192 for the published model."""
        return int(self.width * self.mlp_ratio)

    @property
    def resampler_heads(self) -> int:
        """nn.MultiheadAttention(output_dim, output_dim // 128): 32 heads for output_dim 4096."""
        return self.output_dim // 128


@dataclass(frozen=True)
class QwenVLConfig:
    """What Qwen-VL-Chat's language model has beyond TextConfig."""

    # The training context; past it the rotary base grows (dynamic NTK) and queries are scaled by
    # log(position + 1) / log(seq_length) (logn attention).
    seq_length: int
    use_dynamic_ntk: bool
    use_logn_attn: bool
    # Rotary dimensions per head: kv_channels * rotary_pct (the rest of the head is not rotated).
    rotary_dim: int
    # no_bias: c_proj and the MLP's w1 / w2 / c_proj have no bias (c_attn always has one).
    no_bias: bool
    visual: QwenVisualConfig


def qwen_vl_config(config: ModelConfig) -> QwenVLConfig:
    """The Qwen-VL part of a ModelConfig this family parsed."""
    extra = config.family_config
    assert isinstance(extra, QwenVLConfig), "a Qwen-VL config (model_type 'qwen')"
    return extra


def parse_qwen_vl_config(raw: dict[str, Any]) -> ModelConfig:
    """Qwen-VL-Chat's config.json (QWenConfig of its remote code, fields flat at the top level)."""
    hidden_size = int(require(raw, "hidden_size", "the config"))
    num_heads = int(require(raw, "num_attention_heads", "the config"))
    head_dim = int(raw.get("kv_channels") or hidden_size // num_heads)
    if head_dim * num_heads != hidden_size:
        # The reference splits heads by hidden_size // num_heads but sizes c_attn by kv_channels.
        raise ValueError(
            f"config.json: kv_channels {head_dim} x num_attention_heads {num_heads} must equal hidden_size "
            f"{hidden_size}"
        )
    intermediate_size = int(require(raw, "intermediate_size", "the config"))
    rotary_pct = float(raw.get("rotary_pct", 1.0))
    rotary_dim = int(head_dim * rotary_pct)
    if not 2 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"config.json: rotary_pct {rotary_pct} gives {rotary_dim} rotary dimensions of {head_dim}")
    text = TextConfig(
        vocab_size=int(require(raw, "vocab_size", "the config")),
        hidden_size=hidden_size,
        # NOTE: QWenMLP's w1 / w2 are intermediate_size // 2 wide (22016 -> 11008); this is that width.
        intermediate_size=intermediate_size // 2,
        num_hidden_layers=int(require(raw, "num_hidden_layers", "the config")),
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,  # multi-head attention
        head_dim=head_dim,
        hidden_act="silu",
        rms_norm_eps=float(raw.get("layer_norm_epsilon", 1e-6)),
        rope_theta=float(raw.get("rotary_emb_base", 10000.0)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        mrope_section=None,
    )
    v = raw.get("visual")
    if not isinstance(v, dict):
        raise ValueError("config.json: a Qwen-VL config needs its 'visual' dict")
    visual = QwenVisualConfig(
        image_size=int(v.get("image_size", 448)),
        patch_size=int(v.get("patch_size", 14)),
        width=int(require(v, "width", "visual")),
        layers=int(require(v, "layers", "visual")),
        heads=int(require(v, "heads", "visual")),
        mlp_ratio=float(require(v, "mlp_ratio", "visual")),
        output_dim=int(v.get("output_dim", hidden_size)),
        image_start_id=int(v.get("image_start_id", 151857)),
        n_queries=int(v.get("n_queries", 256)),
    )
    _check_qwen_visual(visual, hidden_size)
    vision = VisionConfig(
        depth=visual.layers,
        embed_dim=visual.width,
        num_heads=visual.heads,
        mlp_ratio=visual.mlp_ratio,
        hidden_size=visual.output_dim,
        in_channels=3,
        patch_size=visual.patch_size,
        temporal_patch_size=1,
        spatial_merge_size=1,
        hidden_act="gelu",
        rope_theta=10000.0,  # unused: the ViT has a learned positional embedding
        intermediate_size=visual.mlp_width,
    )
    return ModelConfig(
        model_type="qwen",
        architecture=(raw.get("architectures") or [QWEN_VL_ARCHITECTURE])[0],
        text=text,
        vision=vision,
        image_token_id=visual.image_start_id,
        video_token_id=-1,
        vision_start_token_id=visual.image_start_id,
        vision_end_token_id=visual.image_start_id + 1,
        checkpoint_dtype=checkpoint_dtype(raw),
        transformers_version=transformers_version(raw),
        family_config=QwenVLConfig(
            seq_length=int(raw.get("seq_length", 2048)),
            use_dynamic_ntk=bool(raw.get("use_dynamic_ntk", True)),
            use_logn_attn=bool(raw.get("use_logn_attn", True)),
            rotary_dim=rotary_dim,
            no_bias=bool(raw.get("no_bias", True)),
            visual=visual,
        ),
    )


def _check_qwen_visual(v: QwenVisualConfig, hidden_size: int) -> None:
    if v.output_dim != hidden_size:
        raise ValueError(
            f"config.json: visual.output_dim {v.output_dim} must equal the language model's hidden_size {hidden_size}"
        )
    if v.resampler_heads < 1 or v.output_dim % v.resampler_heads:
        raise ValueError(
            f"config.json: visual.output_dim {v.output_dim} must be at least 128 and divisible by output_dim // 128 "
            "(the Resampler's number of heads)"
        )
    if v.width % v.heads:
        raise ValueError(f"config.json: visual.width {v.width} is not divisible by visual.heads {v.heads}")
    if v.image_size % v.patch_size:
        raise ValueError(
            f"config.json: visual.image_size {v.image_size} is not a multiple of visual.patch_size {v.patch_size}"
        )
    side = math.isqrt(v.n_queries)
    if side * side != v.n_queries:
        raise ValueError(f"config.json: visual.n_queries {v.n_queries} must be a square (a grid of queries)")
