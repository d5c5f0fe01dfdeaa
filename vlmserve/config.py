"""Model configuration read from a checkpoint's config.json.

Hub checkpoints come in two layouts: transformers 4.x wrote the language model's fields flat at
the top level (with `rope_scaling: {"type": "mrope", ...}`), transformers 5 nests them under
`text_config` (with `rope_parameters`). Both parse into the same frozen dataclasses; every derived
value is computed here once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# model_type -> the architecture a config.json without `architectures` means.
_ARCHITECTURES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
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
class ModelConfig:
    model_type: str
    architecture: str
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    # The dtype the checkpoint was saved in ("auto" resolves to it for CUDA).
    checkpoint_dtype: torch.dtype | None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in _ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; vlmserve runs {' and '.join(_ARCHITECTURES)} checkpoints"
            )
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
