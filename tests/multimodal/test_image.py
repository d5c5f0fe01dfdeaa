"""Pixel values and grids against transformers' Qwen2-VL image processor (PIL backend)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import random_image
from vlmserve.multimodal.image import ImageProcessorConfig, ImageSizing, process_image, smart_resize

CONFIG = ImageProcessorConfig(min_pixels=3136, max_pixels=12845056)


def _compare(hf_image_processor, image: Image.Image, config: ImageProcessorConfig = CONFIG) -> None:  # type: ignore[no-untyped-def]
    ours = process_image(image, config)
    size = {"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels}
    theirs = hf_image_processor([image], size=size, return_tensors="pt")
    assert tuple(theirs["image_grid_thw"][0].tolist()) == ours.grid_thw
    diff = (theirs["pixel_values"] - torch.from_numpy(ours.pixel_values)).abs().max().item()
    assert diff <= 1e-6, f"pixel values differ by {diff}"


def test_seed_001_numbers() -> None:
    # Qwen2-VL's worked example: a 1420 (high) x 720 (wide) image is resized to 1428 x 728 under the published
    # preprocessor_config.json bounds (smart_resize's own default max_pixels, 1003520, would cut
    # it to 1400 x 700).
    assert smart_resize(1420, 720, factor=28, min_pixels=3136, max_pixels=12845056) == (1428, 728)
    assert smart_resize(1420, 720, factor=28) == (1400, 700)
    processed = process_image(random_image(720, 1420), CONFIG)
    assert processed.resized_size == (728, 1428)
    assert processed.grid_thw == (1, 102, 52)
    assert processed.pixel_values.shape == (5304, 1176)  # cu_seqlens [0, 5304, 10608] for two of them
    # A 392 x 392 image has grid (1, 28, 28): 196 placeholder tokens after the 2x2 merge.
    square = process_image(random_image(392, 392), CONFIG)
    assert square.grid_thw == (1, 28, 28)
    assert square.pixel_values.shape[0] // 4 == 196


@pytest.mark.parametrize(
    ("width", "height"),
    [(720, 1420), (392, 392), (150, 100), (123, 77), (29, 1000), (1000, 31), (57, 57), (20, 20), (3, 5), (601, 303)],
)
def test_pixels_match_reference_across_sizes(hf_image_processor, width: int, height: int) -> None:  # type: ignore[no-untyped-def]
    _compare(hf_image_processor, random_image(width, height, seed=width * 7 + height))


# Issue 13: the smallest and thinnest images transformers and qwen-vl-utils accept (1x1 and 1xN up
# to the 200:1 aspect ratio) are scaled up to min_pixels, as there; past 200:1 both raise.
@pytest.mark.parametrize(("width", "height"), [(1, 1), (2, 1), (1, 2), (1, 3), (200, 1), (1, 200), (3, 600)])
def test_tiny_and_thin_images_are_scaled_up_as_transformers_does(hf_image_processor, width: int, height: int) -> None:  # type: ignore[no-untyped-def]
    processed = process_image(random_image(width, height, seed=width + height), CONFIG)
    w, h = processed.resized_size
    assert w * h >= CONFIG.min_pixels and w % 28 == 0 and h % 28 == 0
    _compare(hf_image_processor, random_image(width, height, seed=width + height))


@pytest.mark.parametrize(("width", "height"), [(1, 201), (201, 1), (2, 403), (1000, 4)])
def test_past_200_to_1_both_refuse_and_ours_names_the_size(hf_image_processor, width: int, height: int) -> None:  # type: ignore[no-untyped-def]
    image = random_image(width, height, seed=1)
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        hf_image_processor([image], return_tensors="pt")
    with pytest.raises(ValueError, match=rf"aspect ratio \S+ \({width}x{height}\) exceeds the limit of 200"):
        process_image(image, CONFIG)


def test_above_max_pixels_is_scaled_down(hf_image_processor) -> None:  # type: ignore[no-untyped-def]
    config = ImageProcessorConfig(min_pixels=3136, max_pixels=200_000)
    image = random_image(900, 600, seed=9)
    processed = process_image(image, config)
    w, h = processed.resized_size
    assert w * h <= 200_000 and w % 28 == 0 and h % 28 == 0
    _compare(hf_image_processor, image, config)


def test_below_min_pixels_is_scaled_up(hf_image_processor) -> None:  # type: ignore[no-untyped-def]
    image = random_image(10, 12, seed=5)
    processed = process_image(image, CONFIG)
    w, h = processed.resized_size
    assert w * h >= 3136
    _compare(hf_image_processor, image)


def _modes() -> dict[str, Image.Image]:
    base = random_image(97, 61, seed=11)
    rgba = base.convert("RGBA")
    alpha = np.linspace(0, 255, 97 * 61).reshape(61, 97).astype(np.uint8)
    rgba.putalpha(Image.fromarray(alpha))
    palette_transparent = base.convert("P")
    palette_transparent.info["transparency"] = 3
    sixteen = Image.fromarray(np.asarray(base.convert("L"), dtype=np.uint16) * 257)
    assert sixteen.mode == "I;16"
    return {
        "RGB": base,
        "L": base.convert("L"),
        "RGBA": rgba,
        "LA": rgba.convert("LA"),
        "P": base.convert("P"),
        "P+transparency": palette_transparent,
        "CMYK": base.convert("CMYK"),
        "I;16": sixteen,
    }


@pytest.mark.parametrize("mode", list(_modes()))
def test_pixels_match_reference_across_modes(hf_image_processor, mode: str) -> None:  # type: ignore[no-untyped-def]
    _compare(hf_image_processor, _modes()[mode])


def test_exif_rotated_jpeg_matches_transformers_load_image(hf_image_processor) -> None:  # type: ignore[no-untyped-def]
    from transformers.image_utils import load_image as hf_load_image

    from vlmserve.multimodal.media import load_image

    image = random_image(120, 60, seed=3)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    buf = io.BytesIO()
    image.save(buf, format="JPEG", exif=exif.tobytes())
    ours = load_image(buf.getvalue())
    assert ours.size == (60, 120)  # displayed upright: width and height swap
    reference = hf_load_image(Image.open(io.BytesIO(buf.getvalue())))
    assert reference.size == ours.size
    _compare(hf_image_processor, reference)
    assert np.array_equal(np.asarray(reference), np.asarray(ours.convert("RGB")))


def test_per_item_sizing() -> None:
    image = random_image(640, 480, seed=1)
    small = process_image(image, CONFIG, ImageSizing(max_pixels=50_000))
    w, h = small.resized_size
    assert w * h <= 50_000
    fixed = process_image(image, CONFIG, ImageSizing(resized_height=280, resized_width=420))
    assert fixed.resized_size == (420, 280) and fixed.grid_thw == (1, 20, 30)
    rounded = process_image(image, CONFIG, ImageSizing(resized_height=300, resized_width=400))
    assert rounded.resized_size == (392, 308)  # rounded to multiples of 28
    big = process_image(image, CONFIG, ImageSizing(min_pixels=1_000_000))
    assert big.resized_size[0] * big.resized_size[1] >= 1_000_000


def test_bad_shapes_are_refused_with_reasons() -> None:
    with pytest.raises(ValueError, match="zero-sized"):
        smart_resize(0, 100)
    with pytest.raises(ValueError, match="aspect ratio 250.0 .* exceeds the limit of 200"):
        smart_resize(10, 2500)
    with pytest.raises(ValueError, match="aspect ratio"):
        process_image(Image.new("RGB", (1, 300)), CONFIG)


def test_content_hash_follows_decoded_rgb() -> None:
    base = random_image(64, 64, seed=2)
    same_rgb_other_mode = base.convert("RGBA")  # opaque alpha: identical RGB after compositing
    assert process_image(base, CONFIG).content_hash == process_image(same_rgb_other_mode, CONFIG).content_hash
    other = base.copy()
    other.putpixel((0, 0), (0, 0, 0))
    assert process_image(base, CONFIG).content_hash != process_image(other, CONFIG).content_hash
    # Same pixels resized differently are different encoder inputs.
    assert (
        process_image(base, CONFIG).content_hash
        != process_image(base, CONFIG, ImageSizing(min_pixels=20_000)).content_hash
    )
