"""The Qwen2-VL model against transformers on the same checkpoint files: the vision tower, an
untied nested sharded checkpoint, half precision, bad weights named. Logits and greedy tokens
(whole, chunked, batched, cached) are the families' conformance suite's (tests/families)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.model_harness import Harness
from tests.processor.test_qwen2_vl import make_processor
from tests.reference import hf_logits, hf_prompt_ids
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.processor.base import ImageInput

TWO_IMAGES = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "<|vision_start|><|image_pad|><|vision_end|>and<|vision_start|><|image_pad|><|vision_end|>"
    "compare these two pictures<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def harness(tiny_dir: Path) -> Harness:
    return Harness(tiny_dir, torch.float32)


def _two_image_prompt(tiny_dir: Path, images: dict[str, Image.Image]) -> tuple[ProcessedPrompt, list[Image.Image]]:
    pictures = [images["wide"], images["tall"]]  # different sizes: grids (1, 8, 10) and (1, 14, 4)
    prompt = make_processor(tiny_dir).process(TWO_IMAGES, [ImageInput(p) for p in pictures])
    assert len({item.grid_thw for item in prompt.mm_items}) == 2
    return prompt, pictures


@pytest.mark.parity
def test_vision_tower_matches_transformers(
    tiny_dir: Path, images, harness: Harness, hf_model, hf_image_processor
) -> None:  # type: ignore[no-untyped-def]
    prompt, pictures = _two_image_prompt(tiny_dir, images)
    vision = hf_image_processor(pictures, return_tensors="pt")
    with torch.no_grad():
        reference = hf_model.model.get_image_features(vision["pixel_values"], vision["image_grid_thw"]).pooler_output
    ours = harness.model.embed_multimodal(prompt.mm_items)
    for a, b in zip(ours, reference, strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parity
def test_untied_nested_sharded_checkpoint(tiny_untied_dir: Path, images, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = Qwen2VLForConditionalGeneration.from_pretrained(str(tiny_untied_dir), dtype=torch.float32).eval()
    assert not hf.config.tie_word_embeddings
    prompt, pictures = _two_image_prompt(tiny_untied_dir, images)
    ids, vision = hf_prompt_ids(
        hf_tokenizer, Qwen2VLImageProcessorPil.from_pretrained(str(tiny_untied_dir)), TWO_IMAGES, pictures
    )
    ours = Harness(tiny_untied_dir).logits(prompt)
    assert (ours - hf_logits(hf, ids, vision)).abs().max().item() < 1e-4


@pytest.mark.parity
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_as_accurate_as_transformers(
    tiny_dir: Path,
    images,
    hf_model,
    hf_tokenizer,
    hf_image_processor,
    dtype: torch.dtype,  # type: ignore[no-untyped-def]
) -> None:
    """Against the float32 result, our half-precision logits err no more than transformers' own
    half-precision logits do (rounding happens in the same places)."""
    from transformers import Qwen2VLForConditionalGeneration

    prompt, pictures = _two_image_prompt(tiny_dir, images)
    ids, vision = hf_prompt_ids(hf_tokenizer, hf_image_processor, TWO_IMAGES, pictures)
    truth = hf_logits(hf_model, ids, vision)
    hf_half = Qwen2VLForConditionalGeneration.from_pretrained(str(tiny_dir), dtype=dtype).eval()
    their_error = (hf_logits(hf_half, ids, vision).float() - truth).abs()
    our_error = (Harness(tiny_dir, dtype).logits(prompt) - truth).abs()
    assert our_error.mean() <= 1.25 * their_error.mean()
    assert our_error.max() <= 1.5 * their_error.max()


def test_bad_checkpoint_weights_are_named(tiny_dir: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_proj.weight"]
    weights["visual.unknown.weight"] = torch.zeros(1)
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="visual.unknown.weight"):
        Harness(broken)
    del weights["visual.unknown.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks weights: \['model.layers.1.self_attn.qkv_proj.weight#k'\]"):
        Harness(broken)
