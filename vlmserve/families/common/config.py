"""config.json's fields that every Qwen2-VL-style family reads alike: the architecture, the
special tokens' ids, the checkpoint's dtype and the transformers release that wrote it, around
the text and vision configs the family parsed."""

from __future__ import annotations

from typing import Any

from vlmserve.config import ModelConfig, TextConfig, VisionConfig, checkpoint_dtype, transformers_version

# The vision tokens' ids in the Qwen2 vocabulary (Qwen2-VL to Qwen3-VL), where config.json does not name them.
QWEN2_VISION_TOKEN_IDS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}


def vision_language_config(
    raw: dict[str, Any],
    text_raw: dict[str, Any],
    default_architecture: str,
    text: TextConfig,
    vision: VisionConfig,
    token_ids: dict[str, int] = QWEN2_VISION_TOKEN_IDS,
    **fields: Any,
) -> ModelConfig:
    """The ModelConfig of config.json `raw` (its text section `text_raw`): `architectures[0]` or
    the family's, the vision tokens' ids as given or `token_ids`' defaults; `fields` are the
    family's own (family_config, mm_embedding_rows)."""
    ids = {name: int(raw.get(name, default)) for name, default in token_ids.items()}
    return ModelConfig(
        model_type=raw["model_type"],
        architecture=(raw.get("architectures") or [default_architecture])[0],
        text=text,
        vision=vision,
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        checkpoint_dtype=checkpoint_dtype(raw, text_raw),
        transformers_version=transformers_version(raw),
        **fields,
    )
