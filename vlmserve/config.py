"""Model configuration read from a checkpoint's config.json.

Hub checkpoints come in two layouts: transformers 4.x wrote the language model's fields flat at
the top level (with `rope_scaling: {"type": "mrope", ...}`), transformers 5 nests them under
`text_config` (with `rope_parameters`). Both parse into the same frozen dataclasses; every derived
value is computed here once.

Each family parses its own config.json (vlmserve/families/<family>/config.py, reached through
vlmserve/registry.py by model_type); this module holds the family-neutral parts they fill in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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
    # What only one family has (Qwen-VL-Chat: dynamic NTK, logn attention, the Resampler's sizes),
    # a frozen dataclass of that family's own; None for the others.
    family_config: Any = None
    # [hidden]-wide rows an encoder output holds per placeholder token: 1, or 1 + the per-layer
    # extras a family adds deeper in the decoder (Qwen3-VL's DeepStack). Sizes the encoder cache.
    mm_embedding_rows: int = 1
    # config.json's transformers_version: the transformers release that wrote the checkpoint (what
    # its weights' layout may depend on), or None.
    transformers_version: str | None = None
    # Build the model with its speculative-decoding draft head (Qwen3.5's multi-token prediction),
    # whose layers cost KV cache: not a field of config.json, set by build_model when asked.
    draft_head: bool = False


@dataclass(frozen=True)
class FieldAliases:
    """Other names config.json may give a field -> the name a family's parser reads, per section.

    transformers' config classes accept a field under two names (their `attribute_map`): Qwen3-VL's
    vision config takes `num_attention_heads` for `num_heads`, Qwen3-VL-MoE's text config writes
    `num_experts` as `num_local_experts`. A family lists those names (and any its published files
    used) here once; its parser reads each field under one name from the sections this returns."""

    text: Mapping[str, str] = field(default_factory=dict)
    vision: Mapping[str, str] = field(default_factory=dict)

    def text_section(self, raw: dict[str, Any]) -> dict[str, Any]:
        """The language model's fields: `text_config` (transformers 5's layout), else the top level (4.x's)."""
        nested = raw.get("text_config")
        return _rename_aliases(nested or raw, self.text, "text_config" if nested else "the top level")

    def vision_section(self, raw: dict[str, Any]) -> dict[str, Any]:
        return _rename_aliases(raw.get("vision_config") or {}, self.vision, "vision_config")


def _rename_aliases(section: dict[str, Any], aliases: Mapping[str, str], where: str) -> dict[str, Any]:
    """A copy of `section` with each alias renamed to its field's name; a field given under both
    names with two values is refused (transformers would keep one of them silently)."""
    out = dict(section)
    for alias, name in aliases.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if name in out and out[name] != value:
            raise ValueError(
                f"config.json: {where} gives one field twice with different values: {name!r} is {out[name]!r} "
                f"and {alias!r} (another name for it) is {value!r}; keep one of them"
            )
        out[name] = value
    return out


def require(d: dict[str, Any], key: str, where: str, aliases: Mapping[str, str] | None = None) -> Any:
    """d[key], or an error naming the field (and its other names in `aliases`, alias -> name)."""
    if key not in d:
        others = [alias for alias, name in (aliases or {}).items() if name == key]
        also = f" (or {', '.join(map(repr, others))})" if others else ""
        raise ValueError(f"config.json: {where} lacks required field {key!r}{also}")
    return d[key]


def parse_text_config(text_raw: dict[str, Any], top: dict[str, Any]) -> TextConfig:
    hidden_size = int(require(text_raw, "hidden_size", "the text config"))
    num_heads = int(require(text_raw, "num_attention_heads", "the text config"))
    rope = text_raw.get("rope_parameters") or text_raw.get("rope_scaling") or top.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", text_raw.get("rope_theta", top.get("rope_theta", 1_000_000.0)))
    mrope_section = rope.get("mrope_section")
    head_dim = int(text_raw.get("head_dim") or hidden_size // num_heads)
    if mrope_section is not None and 2 * sum(mrope_section) != head_dim:
        raise ValueError(f"config.json: mrope_section {mrope_section} must sum to head_dim / 2 = {head_dim // 2}")
    # A 4.x save may put tie_word_embeddings inside text_config; the top level wins when present.
    tie = top.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False))
    return TextConfig(
        vocab_size=int(require(text_raw, "vocab_size", "the text config")),
        hidden_size=hidden_size,
        intermediate_size=int(require(text_raw, "intermediate_size", "the text config")),
        num_hidden_layers=int(require(text_raw, "num_hidden_layers", "the text config")),
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


def read_config_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return raw


def transformers_version(raw: dict[str, Any]) -> str | None:
    """config.json's transformers_version (the release that wrote it), as a string."""
    version = raw.get("transformers_version")
    return None if version is None else str(version)


def checkpoint_dtype(raw: dict[str, Any], text_raw: dict[str, Any] | None = None) -> torch.dtype | None:
    """The dtype config.json says the weights were saved in (transformers 4.x: torch_dtype, 5: dtype)."""
    inner = text_raw or {}
    name = raw.get("torch_dtype") or raw.get("dtype") or inner.get("torch_dtype") or inner.get("dtype")
    return parse_dtype(name) if name else None
