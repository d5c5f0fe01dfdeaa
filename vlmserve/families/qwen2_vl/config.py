"""config.json of Qwen2-VL and Qwen2.5-VL, in both published layouts: transformers 4.x wrote the
language model's fields flat at the top level (with `rope_scaling: {"type": "mrope", ...}`),
transformers 5 nests them under `text_config` (with `rope_parameters`)."""

from __future__ import annotations

from typing import Any

from vlmserve.config import FieldAliases, ModelConfig, VisionConfig, parse_text_config
from vlmserve.families.common.config import vision_language_config

QWEN2_VL_ARCHITECTURE = "Qwen2VLForConditionalGeneration"
QWEN2_5_VL_ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"

# The attribute_map of transformers' Qwen2VLVisionConfig and Qwen2_5_VLVisionConfig (5.23 and 5.24),
# and the names the published 4.x config.json files give the channels and the patch size.
ALIASES = FieldAliases(
    vision={
        "num_attention_heads": "num_heads",
        "num_hidden_layers": "depth",
        "in_chans": "in_channels",
        "spatial_patch_size": "patch_size",
    }
)


def parse_qwen2_vl_config(raw: dict[str, Any]) -> ModelConfig:
    return _parse(raw, _parse_vision_config, QWEN2_VL_ARCHITECTURE)


def parse_qwen2_5_vl_config(raw: dict[str, Any]) -> ModelConfig:
    return _parse(raw, _parse_qwen2_5_vision_config, QWEN2_5_VL_ARCHITECTURE)


def _parse(raw: dict[str, Any], parse_vision: Any, default_architecture: str) -> ModelConfig:
    text_raw = ALIASES.text_section(raw)
    text = parse_text_config(text_raw, raw)
    vision: VisionConfig = parse_vision(ALIASES.vision_section(raw), text.hidden_size)
    if vision.hidden_size != text.hidden_size:
        raise ValueError(
            f"config.json: the vision tower's output width {vision.hidden_size} must equal the language "
            f"model's hidden_size {text.hidden_size}"
        )
    return vision_language_config(raw, text_raw, default_architecture, text, vision)


def _parse_vision_config(v: dict[str, Any], text_hidden_size: int) -> VisionConfig:
    rope = v.get("rope_parameters") or {}
    return VisionConfig(
        depth=int(v.get("depth", 32)),
        embed_dim=int(v.get("embed_dim", 1280)),
        num_heads=int(v.get("num_heads", 16)),
        mlp_ratio=float(v.get("mlp_ratio", 4)),
        hidden_size=int(v.get("hidden_size", text_hidden_size)),
        in_channels=int(v.get("in_channels", 3)),
        patch_size=int(v.get("patch_size", 14)),
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
        in_channels=int(v.get("in_channels", 3)),
        patch_size=int(v.get("patch_size", 14)),
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
