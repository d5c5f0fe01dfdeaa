"""Model configuration read from a checkpoint's config.json.

Hub checkpoints come in two layouts: transformers 4.x wrote the language model's fields flat at
the top level (with `rope_scaling: {"type": "mrope", ...}`), transformers 5 nests them under
`text_config` (with `rope_parameters`). Both parse into the same frozen dataclasses; every derived
value is computed here once.

Qwen-VL-Chat (model_type "qwen", remote code) names its fields differently (kv_channels,
rotary_emb_base, layer_norm_epsilon, a "visual" dict); it parses into the same TextConfig and
VisionConfig plus a QwenVLConfig holding what only that family has (dynamic NTK, logn attention,
the Resampler's sizes).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# model_type -> the architecture a config.json without `architectures` means.
_ARCHITECTURES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen": "QWenLMHeadModel",  # Qwen-VL-Chat
}

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use one of float32, bfloat16, float16")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of float32, bfloat16, float16")
    return _DTYPES[name]


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # M-RoPE: how many of the head_dim // 2 rotary frequencies encode t, h and w.
    mrope_section: tuple[int, ...] | None


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: float
    hidden_size: int  # width of the merger's output, i.e. the language model's hidden size
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    hidden_act: str
    rope_theta: float
    # Qwen2.5-VL: temporal M-RoPE positions per second of video (absolute time); None for Qwen2-VL,
    # whose video frames advance the temporal position by one per temporal patch.
    tokens_per_second: float | None = None
    # Qwen2.5-VL: width of the vision blocks' SwiGLU MLP (Qwen2-VL's GELU MLP is embed_dim * mlp_ratio).
    intermediate_size: int | None = None
    # Qwen2.5-VL window attention: most blocks attend within windows of window_size x window_size
    # pixels of a frame; the blocks in fullatt_block_indexes attend over the whole frame. None for
    # Qwen2-VL, whose blocks all attend over the whole frame.
    window_size: int | None = None
    fullatt_block_indexes: tuple[int, ...] = ()

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merged_window_size(self) -> int:
        """Window side in merged tokens (window_size 112, patch 14, merge 2: 4 x 4 merged tokens)."""
        assert self.window_size is not None, "Qwen2-VL has no window attention"
        return self.window_size // self.patch_size // self.spatial_merge_size


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


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    architecture: str
    text: TextConfig
    vision: VisionConfig
    # Qwen2-VL / Qwen2.5-VL: the placeholder token an image's embeddings replace. Qwen-VL-Chat: the
    # <img> token (visual.image_start_id, 151857), which is not replaced itself: the 256 tokens after
    # it (the image URL's bytes padded with <imgpad> = image_start_id + 2) are, up to </img>
    # (= image_start_id + 1); vision_start / vision_end_token_id are <img> / </img> there.
    image_token_id: int
    video_token_id: int  # -1 for Qwen-VL-Chat, which takes no videos
    vision_start_token_id: int
    vision_end_token_id: int
    # The dtype the checkpoint was saved in ("auto" resolves to it for CUDA).
    checkpoint_dtype: torch.dtype | None
    # Qwen-VL-Chat only: dynamic NTK, logn attention and the Resampler's sizes.
    qwen_vl: QwenVLConfig | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in _ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; vlmserve runs {' and '.join(_ARCHITECTURES)} checkpoints"
            )
        if model_type == "qwen":
            return _parse_qwen_vl_config(raw)
        architectures = raw.get("architectures") or [_ARCHITECTURES[model_type]]
        # transformers 5 nests the language model's fields; 4.x keeps them at the top level.
        text_raw: dict[str, Any] = raw.get("text_config") or raw
        text = _parse_text_config(text_raw, raw)
        vision_raw = raw.get("vision_config") or {}
        vision = (
            _parse_qwen2_5_vision_config(vision_raw, text.hidden_size)
            if model_type == "qwen2_5_vl"
            else _parse_vision_config(vision_raw, text.hidden_size)
        )
        if vision.hidden_size != text.hidden_size:
            raise ValueError(
                f"config.json: the vision tower's output width {vision.hidden_size} must equal the language "
                f"model's hidden_size {text.hidden_size}"
            )
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or text_raw.get("torch_dtype") or text_raw.get("dtype")
        return cls(
            model_type=model_type,
            architecture=architectures[0],
            text=text,
            vision=vision,
            image_token_id=int(raw.get("image_token_id", 151655)),
            video_token_id=int(raw.get("video_token_id", 151656)),
            vision_start_token_id=int(raw.get("vision_start_token_id", 151652)),
            vision_end_token_id=int(raw.get("vision_end_token_id", 151653)),
            checkpoint_dtype=parse_dtype(dtype_name) if dtype_name else None,
        )

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)


def _require(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ValueError(f"config.json: {where} lacks required field {key!r}")
    return d[key]


def _parse_text_config(text_raw: dict[str, Any], top: dict[str, Any]) -> TextConfig:
    hidden_size = int(_require(text_raw, "hidden_size", "the text config"))
    num_heads = int(_require(text_raw, "num_attention_heads", "the text config"))
    rope = text_raw.get("rope_parameters") or text_raw.get("rope_scaling") or top.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", text_raw.get("rope_theta", top.get("rope_theta", 1_000_000.0)))
    mrope_section = rope.get("mrope_section")
    head_dim = int(text_raw.get("head_dim") or hidden_size // num_heads)
    if mrope_section is not None and 2 * sum(mrope_section) != head_dim:
        raise ValueError(f"config.json: mrope_section {mrope_section} must sum to head_dim / 2 = {head_dim // 2}")
    # A 4.x save may put tie_word_embeddings inside text_config; the top level wins when present.
    tie = top.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False))
    return TextConfig(
        vocab_size=int(_require(text_raw, "vocab_size", "the text config")),
        hidden_size=hidden_size,
        intermediate_size=int(_require(text_raw, "intermediate_size", "the text config")),
        num_hidden_layers=int(_require(text_raw, "num_hidden_layers", "the text config")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(text_raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        hidden_act=text_raw.get("hidden_act", "silu"),
        rms_norm_eps=float(text_raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=int(text_raw.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(tie),
        mrope_section=tuple(int(x) for x in mrope_section) if mrope_section is not None else None,
    )


def _parse_vision_config(v: dict[str, Any], text_hidden_size: int) -> VisionConfig:
    rope = v.get("rope_parameters") or {}
    return VisionConfig(
        depth=int(v.get("depth", 32)),
        embed_dim=int(v.get("embed_dim", 1280)),
        num_heads=int(v.get("num_heads", 16)),
        mlp_ratio=float(v.get("mlp_ratio", 4)),
        hidden_size=int(v.get("hidden_size", text_hidden_size)),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        patch_size=int(v.get("patch_size", v.get("spatial_patch_size", 14))),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        hidden_act=v.get("hidden_act", "quick_gelu"),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )


def _parse_qwen2_5_vision_config(v: dict[str, Any], text_hidden_size: int) -> VisionConfig:
    """Qwen2.5-VL names the vision tower's own width `hidden_size` and the merger's output width
    `out_hidden_size` (Qwen2-VL: `embed_dim` and `hidden_size`). Defaults as transformers'
    Qwen2_5_VLVisionConfig, except that a missing output width is the language model's."""
    rope = v.get("rope_parameters") or {}
    config = VisionConfig(
        depth=int(v.get("depth", 32)),
        embed_dim=int(v.get("hidden_size", 3584)),
        num_heads=int(v.get("num_heads", 16)),
        mlp_ratio=4.0,  # unused: the MLP width is intermediate_size
        hidden_size=int(v.get("out_hidden_size", text_hidden_size)),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        patch_size=int(v.get("patch_size", v.get("spatial_patch_size", 14))),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        hidden_act=v.get("hidden_act", "silu"),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        tokens_per_second=float(v.get("tokens_per_second", 4)),
        intermediate_size=int(v.get("intermediate_size", 3420)),
        window_size=int(v.get("window_size", 112)),
        fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31))),
    )
    if config.merged_window_size < 1:
        raise ValueError(
            f"config.json: vision_config.window_size {config.window_size} must be at least patch_size * "
            f"spatial_merge_size = {config.patch_size * config.spatial_merge_size} pixels"
        )
    bad = [i for i in config.fullatt_block_indexes if not 0 <= i < config.depth]
    if bad:
        raise ValueError(
            f"config.json: vision_config.fullatt_block_indexes {list(config.fullatt_block_indexes)} name blocks "
            f"outside 0..{config.depth - 1}"
        )
    return config


def _parse_qwen_vl_config(raw: dict[str, Any]) -> ModelConfig:
    """Qwen-VL-Chat's config.json (QWenConfig of its remote code, fields flat at the top level)."""
    hidden_size = int(_require(raw, "hidden_size", "the config"))
    num_heads = int(_require(raw, "num_attention_heads", "the config"))
    head_dim = int(raw.get("kv_channels") or hidden_size // num_heads)
    if head_dim * num_heads != hidden_size:
        # The reference splits heads by hidden_size // num_heads but sizes c_attn by kv_channels.
        raise ValueError(
            f"config.json: kv_channels {head_dim} x num_attention_heads {num_heads} must equal hidden_size "
            f"{hidden_size}"
        )
    intermediate_size = int(_require(raw, "intermediate_size", "the config"))
    rotary_pct = float(raw.get("rotary_pct", 1.0))
    rotary_dim = int(head_dim * rotary_pct)
    if not 2 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"config.json: rotary_pct {rotary_pct} gives {rotary_dim} rotary dimensions of {head_dim}")
    text = TextConfig(
        vocab_size=int(_require(raw, "vocab_size", "the config")),
        hidden_size=hidden_size,
        # NOTE: QWenMLP's w1 / w2 are intermediate_size // 2 wide (22016 -> 11008); this is that width.
        intermediate_size=intermediate_size // 2,
        num_hidden_layers=int(_require(raw, "num_hidden_layers", "the config")),
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
        width=int(_require(v, "width", "visual")),
        layers=int(_require(v, "layers", "visual")),
        heads=int(_require(v, "heads", "visual")),
        mlp_ratio=float(_require(v, "mlp_ratio", "visual")),
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
    dtype_name = raw.get("torch_dtype") or raw.get("dtype")
    return ModelConfig(
        model_type="qwen",
        architecture=(raw.get("architectures") or [_ARCHITECTURES["qwen"]])[0],
        text=text,
        vision=vision,
        image_token_id=visual.image_start_id,
        video_token_id=-1,
        vision_start_token_id=visual.image_start_id,
        vision_end_token_id=visual.image_start_id + 1,
        checkpoint_dtype=parse_dtype(dtype_name) if dtype_name else None,
        qwen_vl=QwenVLConfig(
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
