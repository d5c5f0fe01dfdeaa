"""Qwen2-VL image preprocessing: smart_resize, normalisation and patch flattening.

The steps and their order follow transformers' Qwen2-VL image processor (PIL backend), so pixel
values agree with it to float32 rounding: RGB conversion compositing transparency onto white,
a bicubic PIL resize to multiples of patch_size * merge_size, rescale by 1/255 computed in
float64, normalisation in float32, then the patch layout

    (grid_h / m, grid_w / m, m, m, channel, temporal_patch, patch, patch)

flattened to [grid_h * grid_w, 3 * 2 * 14 * 14 = 1176], a still image repeated along the
temporal patch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

MAX_ASPECT_RATIO = 200
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 14 * 14 * 4 * 1280
) -> tuple[int, int]:
    """The (height, width) closest to the input that is a multiple of `factor` in both
    dimensions and holds between `min_pixels` and `max_pixels` pixels.

    Qwen2-VL's worked example: 1420 x 720 with factor 28 becomes 1428 x 728.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image is zero-sized ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} ({width}x{height}) "
            f"exceeds the limit of {MAX_ASPECT_RATIO}"
        )
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels ({min_pixels}) must not exceed max_pixels ({max_pixels})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency (alpha band or palette transparency) composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")  # convert() would copy an RGB image


@dataclass(frozen=True)
class ImageProcessorConfig:
    """preprocessor_config.json fields the Qwen2-VL image processor uses."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> ImageProcessorConfig:
        size = d.get("size") if isinstance(d.get("size"), dict) else {}
        assert isinstance(size, dict)
        default = cls()

        def pick(*values: object) -> object:
            return next(v for v in values if v is not None)

        return cls(
            min_pixels=int(pick(d.get("min_pixels"), size.get("shortest_edge"), default.min_pixels)),  # type: ignore[call-overload]
            max_pixels=int(pick(d.get("max_pixels"), size.get("longest_edge"), default.max_pixels)),  # type: ignore[call-overload]
            patch_size=int(d.get("patch_size", default.patch_size)),  # type: ignore[call-overload]
            temporal_patch_size=int(d.get("temporal_patch_size", default.temporal_patch_size)),  # type: ignore[call-overload]
            merge_size=int(d.get("merge_size", default.merge_size)),  # type: ignore[call-overload]
            image_mean=tuple(d.get("image_mean", default.image_mean)),  # type: ignore[arg-type]
            image_std=tuple(d.get("image_std", default.image_std)),  # type: ignore[arg-type]
            rescale_factor=float(d.get("rescale_factor", default.rescale_factor)),  # type: ignore[arg-type]
        )


# OpenAI's image `detail`: "low" is a budget of LOW_DETAIL_TOKENS tokens (LOW_DETAIL_TOKENS *
# (patch_size * merge_size)^2 pixels: 448x448 for Qwen2-VL and Qwen2.5-VL's 28-pixel tokens,
# 512x512 for Qwen3-VL and Qwen3.5's 32-pixel ones, OpenAI's own low-detail size); "high" and
# "original" the server's max_pixels; "auto" the defaults (the server's min_pixels and max_pixels,
# so the same budget as "high").
LOW_DETAIL_TOKENS = 256
DETAILS = ("low", "high", "auto", "original")


@dataclass(frozen=True)
class ImageSizing:
    """Per-item resize options in qwen-vl-utils' vocabulary; None means the processor default.
    `detail` (OpenAI's) chooses the default budget; min_pixels, max_pixels and an explicit size
    win over it."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    resized_height: int | None = None
    resized_width: int | None = None
    detail: str | None = None

    @property
    def resizes(self) -> bool:
        """Whether an option other than `detail` (a hint a fixed-size family may ignore) is given."""
        return dataclasses.replace(self, detail=None) != ImageSizing()


def check_sizing(sizing: ImageSizing, cfg: ImageProcessorConfig) -> None:
    """A per-image option may lower the image's size, never raise it above the server's own
    max_pixels (the checkpoint's preprocessor max_pixels, or --max-pixels): a ValueError naming
    the field and the numbers, not a silent clamp."""
    limit = cfg.max_pixels
    for name in ("min_pixels", "max_pixels"):
        value = getattr(sizing, name)
        if value is not None and value > limit:
            raise ValueError(f"{name}={value} exceeds the server's max_pixels={limit}")
    if sizing.resized_height is not None and sizing.resized_width is not None:
        pixels = sizing.resized_height * sizing.resized_width
        if pixels > limit:
            raise ValueError(
                f"resized_height={sizing.resized_height} x resized_width={sizing.resized_width} = {pixels} pixels "
                f"exceeds the server's max_pixels={limit}"
            )


def target_size(width: int, height: int, cfg: ImageProcessorConfig, sizing: ImageSizing) -> tuple[int, int]:
    """(resized_height, resized_width) for an image of `width` x `height`; sizing held to
    check_sizing."""
    check_sizing(sizing, cfg)
    default_min, default_max = cfg.min_pixels, cfg.max_pixels
    if sizing.detail == "low":
        default_max = min(LOW_DETAIL_TOKENS * cfg.factor**2, cfg.max_pixels)
        # A min_pixels of the item's own wins over the budget (qwen-vl-utils' keys win over detail).
        default_max = max(default_max, sizing.min_pixels or 0)
        default_min = min(default_min, default_max)
    min_pixels = sizing.min_pixels if sizing.min_pixels is not None else default_min
    max_pixels = sizing.max_pixels if sizing.max_pixels is not None else default_max
    if sizing.resized_height is not None and sizing.resized_width is not None:
        # qwen-vl-utils: an explicit size is only rounded to the patch grid.
        return smart_resize(sizing.resized_height, sizing.resized_width, cfg.factor, min_pixels, max_pixels)
    return smart_resize(height, width, cfg.factor, min_pixels, max_pixels)


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray  # [grid_h * grid_w, patch_dim] float32
    grid_thw: tuple[int, int, int]
    original_size: tuple[int, int]  # (width, height) as decoded, after EXIF rotation
    resized_size: tuple[int, int]  # (width, height) the model saw
    content_hash: str


def normalize_lut(cfg: ImageProcessorConfig) -> np.ndarray:
    """[3, 256] float32: the normalised value of every uint8 level per channel, computed with the
    same float64 rescale then float32 normalise as the reference, so a lookup is bit-identical."""
    levels = (np.arange(256, dtype=np.float64) * cfg.rescale_factor).astype(np.float32)
    mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None]
    std = np.asarray(cfg.image_std, dtype=np.float32)[:, None]
    return (levels[None, :] - mean) / std


def process_image(image: Image.Image, cfg: ImageProcessorConfig, sizing: ImageSizing = ImageSizing()) -> ProcessedImage:
    width, height = image.size
    resized_h, resized_w = target_size(width, height, cfg, sizing)
    rgb = to_rgb(image)
    if rgb.size != (resized_w, resized_h):
        rgb = rgb.resize((resized_w, resized_h), resample=Image.Resampling.BICUBIC)
    pixels = np.asarray(rgb, dtype=np.uint8)  # [H, W, 3]
    content_hash = _content_hash(pixels, cfg)

    lut = normalize_lut(cfg)
    chw = lut[np.arange(3)[:, None, None], pixels.transpose(2, 0, 1)]  # [3, H, W] float32
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    grid_h, grid_w = resized_h // p, resized_w // p
    patches = chw.reshape(3, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, p, p]
    # A still image fills every temporal slot of its patch with the same frame.
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    pixel_values = np.ascontiguousarray(patches.reshape(grid_h * grid_w, 3 * t * p * p))
    return ProcessedImage(
        pixel_values=pixel_values,
        grid_thw=(1, grid_h, grid_w),
        original_size=(width, height),
        resized_size=(resized_w, resized_h),
        content_hash=content_hash,
    )


def _content_hash(pixels: np.ndarray, cfg: ImageProcessorConfig) -> str:
    """Identifies the encoder input: the resized RGB pixels and everything that turns them into
    patches. The same picture in two modes hashes the same only if its RGB is identical."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((pixels.shape, cfg)).encode())
    h.update(pixels.tobytes())
    return h.hexdigest()
