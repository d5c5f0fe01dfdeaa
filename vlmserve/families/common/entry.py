"""The pieces of a family's entry (vlmserve/family.py's ModelFamily) that families fill alike:
the image processor's config with the engine-wide options, `write_tiny` over a family's presets,
where `vlmserve inspect` finds the parts of a Qwen2-VL-style model, and the box tokens of the
Qwen2 vocabulary its grounding convention reads."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from vlmserve.family import ProcessorContext
from vlmserve.grounding import BoxTags
from vlmserve.model_files import read_json
from vlmserve.multimodal.image import ImageProcessorConfig

# The engine-wide options (LLM(mm_processor_kwargs=...)) the smart_resize processors take.
PIXEL_OPTIONS = ("min_pixels", "max_pixels")

# Where `vlmserve inspect` finds the parts of a model built as families/common/model.py's
# VisionLanguageModel names them (the published checkpoints' module names), and its adapter.
INSPECT_PARTS = {
    "embedding": "model.embed_tokens",
    "blocks": "model.layers",
    "final_norm": "model.norm",
    "visual": "visual",
    "adapter": "visual.merger",
}
MERGER_NAME = "patch merger (merger)"

# Boxes in the special tokens of the Qwen2 vocabulary (Qwen2-VL onwards).
BOX_TOKENS = BoxTags(
    ref=("<|object_ref_start|>", "<|object_ref_end|>"),
    box=("<|box_start|>", "<|box_end|>"),
    quad=("<|quad_start|>", "<|quad_end|>"),
)


def no_extra_eos(tokenizer: Any) -> list[int]:
    """ModelFamily.extra_eos_token_ids of a family whose generation_config.json says it all."""
    del tokenizer
    return []


def image_processor_config(ctx: ProcessorContext, options: tuple[str, ...] = PIXEL_OPTIONS) -> ImageProcessorConfig:
    """preprocessor_config.json with the engine-wide options (ctx.mm_processor_kwargs) over it; an
    option the processor does not take is refused by name."""
    unknown = set(ctx.mm_processor_kwargs) - set(options)
    if unknown:
        raise ValueError(f"mm_processor_kwargs: unknown keys {sorted(unknown)}; supported: {', '.join(options)}")
    preprocessor = read_json(ctx.model_dir / "preprocessor_config.json") | dict(ctx.mm_processor_kwargs)
    return ImageProcessorConfig.from_dict(preprocessor)


Layouts = Literal["flat", "nested", "flat or nested"]


def preset_writer(
    arch: str, presets: Mapping[tuple[str, str], Any], write: Callable[..., Path], layouts: Layouts
) -> Callable[..., Path]:
    """ModelFamily.write_tiny for the specs in `presets`, by (arch, preset name):
    write_tiny(out_dir, seed=, num_shards=, preset=, nested_config=, untied=) writes
    presets[(arch, preset)] through write(out_dir, spec, seed=, num_shards=[, nested_config=]).
    `layouts` are the config.json layouts the family publishes: "flat or nested" passes
    nested_config on (transformers 4.x's flat layout, or 5's text_config); with one layout
    nested_config asks for that one or is refused. `untied` unties a spec's embedding (a spec
    without tie_word_embeddings is untied already)."""

    def write_tiny(
        out_dir: str | Path,
        *,
        seed: int = 0,
        num_shards: int = 1,
        preset: str = "tiny",
        nested_config: bool = False,
        untied: bool = False,
    ) -> Path:
        if (arch, preset) not in presets:
            raise ValueError(f"no preset {preset!r}; choose one of {sorted(p for a, p in presets if a == arch)}")
        if nested_config and layouts == "flat":
            raise ValueError(f"--arch {arch} is published in one config layout, the flat one (no --nested-config)")
        spec = presets[(arch, preset)]
        if untied and getattr(spec, "tie_word_embeddings", False):
            spec = dataclasses.replace(spec, tie_word_embeddings=False)
        if layouts == "flat or nested":
            return write(out_dir, spec, seed=seed, num_shards=num_shards, nested_config=nested_config)
        return write(out_dir, spec, seed=seed, num_shards=num_shards)

    return write_tiny
