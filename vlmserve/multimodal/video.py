"""Qwen2-VL / Qwen2.5-VL video preprocessing with qwen-vl-utils' semantics (fetch_video).

A video is a file (path, file:// / data: / http(s) URL or bytes; video_decode reads it with
PyAV) or a list of frames (anything load_image accepts, or a uint8 array [frames, height, width, 3]).

Which frames, for a file (qwen-vl-utils' decord and torchcodec readers): video_start / video_end
select frames ceil(start * fps) .. floor(end * fps); `nframes` frames are taken from them, or
`fps` per second (default 2) held between min_frames (4) and max_frames (768, and the frames
there are), rounded down to a multiple of the temporal patch (2); their indices are
linspace(first, last, nframes) rounded half to even, and sample_fps = nframes / frames * video fps.
A list of frames is used as given, the last frame repeated to an even count, taken sample_fps
(default 2) per second; the options that choose frames of a file are refused for it.

Their size: smart_resize to multiples of 28 within [min_pixels, max_pixels], where min_pixels
defaults to 128 * 28 * 28 and max_pixels is
max(min(768 * 28 * 28, total_pixels / nframes * 2), min_pixels * 1.05), lowered to the item's
max_pixels; total_pixels defaults to 128000 * 28 * 28 * 0.9. resized_height / resized_width
replace the frame's size before the rounding. Frames of a list start from the size qwen-vl-utils
first fits them to as images (list_frame_size), so the sizes, and token counts, agree with it.

Then qwen-vl-utils' resize (torchvision's float bicubic with antialias; a frame of a list is first
fitted to list_frame_size with PIL's bicubic, as fetch_image does), the image path's rescale and
normalisation, and its patch layout with real consecutive frames in the temporal slots: temporal
patch k holds frames 2k and 2k + 1, giving [grid_t * grid_h * grid_w, 3 * 2 * 14 * 14] with
grid_t = nframes / 2. A temporal patch spans second_per_grid_t = 2 / sample_fps seconds, which
Qwen2.5-VL's M-RoPE uses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlmserve.multimodal.image import ImageProcessorConfig, normalize_lut, smart_resize, to_rgb
from vlmserve.multimodal.media import DEFAULT_LIMITS, MediaError, MediaLimits, load_image, read_source
from vlmserve.multimodal.video_decode import ContainerIndex, decode_frames, index_container

# qwen-vl-utils' defaults, in tokens of factor x factor pixels (factor = patch_size * merge_size).
DEFAULT_FPS = 2.0
DEFAULT_SAMPLE_FPS = 2.0
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768
VIDEO_MIN_TOKENS = 128
VIDEO_MAX_TOKENS = 768
IMAGE_MIN_TOKENS = 4
IMAGE_MAX_TOKENS = 16384
MODEL_SEQ_LEN = 128000
# A list of frames longer than qwen-vl-utils ever samples from a file is refused.
MAX_LIST_FRAMES = FPS_MAX_FRAMES

INT_OPTIONS = ("nframes", "min_frames", "max_frames", "min_pixels", "max_pixels", "resized_height", "resized_width")
NUMBER_OPTIONS = ("fps", "total_pixels", "sample_fps")
TIME_OPTIONS = ("video_start", "video_end")
FILE_ONLY_OPTIONS = ("fps", "nframes", "min_frames", "max_frames", "video_start", "video_end")
# Past any sensible frame count, pixel count or time; keeps the arithmetic on options finite.
MAX_OPTION = 10**12
# A list of frames spans at most an hour per frame and at least a millisecond.
SAMPLE_FPS_RANGE = (1 / 3600, 1000.0)


@dataclass(frozen=True)
class VideoOptions:
    """Per-video options in qwen-vl-utils' vocabulary; None means its default."""

    fps: float | None = None
    nframes: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    video_start: float | None = None  # seconds
    video_end: float | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: float | None = None
    resized_height: int | None = None
    resized_width: int | None = None
    # A list of frames: how many of them per second of the scene.
    sample_fps: float | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], label: str) -> VideoOptions:
        """The options among `d`'s keys, validated; other keys are left alone."""
        values: dict[str, Any] = {}
        for key in INT_OPTIONS:
            if key in d and d[key] is not None:
                value = d[key]
                if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_OPTION:
                    raise MediaError(
                        f"{label}: {key} must be a positive integer up to {MAX_OPTION:.0e}, got {_shown(value)}"
                    )
                values[key] = value
        for key in NUMBER_OPTIONS + TIME_OPTIONS:
            if key in d and d[key] is not None:
                value = d[key]
                number = not isinstance(value, bool) and isinstance(value, (int, float))
                # NaN fails every comparison; huge ints are compared exactly, never converted.
                if not number or not 0 <= value <= MAX_OPTION or (value == 0 and key in NUMBER_OPTIONS):
                    kind = "a non-negative number of seconds" if key in TIME_OPTIONS else "a positive number"
                    raise MediaError(f"{label}: {key} must be {kind} up to {MAX_OPTION:.0e}, got {_shown(value)}")
                values[key] = value
        low, high = SAMPLE_FPS_RANGE
        if "sample_fps" in values and not low <= values["sample_fps"] <= high:
            raise MediaError(f"{label}: sample_fps must be between {low:g} and {high:g} frames per second")
        if "fps" in values and "nframes" in values:
            raise MediaError(f"{label}: give fps or nframes, not both")
        if ("resized_height" in values) != ("resized_width" in values):
            raise MediaError(f"{label}: resized_height and resized_width must be given together")
        start, end = values.get("video_start"), values.get("video_end")
        if start is not None and end is not None and start >= end:
            raise MediaError(f"{label}: video_start ({start}s) must be before video_end ({end}s)")
        return cls(**values)


OPTION_KEYS = tuple(f.name for f in dataclasses.fields(VideoOptions))


def _shown(value: object) -> str:
    """A user's value for an error message, short."""
    if isinstance(value, int) and value.bit_length() > 64:
        return "a very large integer"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# -- which frames (pure; tests compare these with qwen-vl-utils) ------------------------------------


def frame_range(
    total_frames: int, video_fps: float, video_start: float | None, video_end: float | None, label: str = "video"
) -> tuple[int, int]:
    """(first, last) frame, inclusive, of the video_start .. video_end span in seconds."""
    if video_start is None and video_end is None:
        return 0, total_frames - 1
    duration = total_frames / video_fps
    first = math.ceil(max(0.0, min(video_start, duration)) * video_fps) if video_start is not None else 0
    last = total_frames - 1
    if video_end is not None:
        last = min(math.floor(max(0.0, min(video_end, duration)) * video_fps), total_frames - 1)
    if first >= last:
        bounds = (("video_start", video_start), ("video_end", video_end))
        given = " and ".join(f"{name}={value:g}s" for name, value in bounds if value is not None)
        raise MediaError(
            f"{label}: {given} select(s) fewer than 2 frames of the "
            f"{duration:.2f}s video ({total_frames} frames at {video_fps:g} fps)"
        )
    return first, last


def num_frames(
    options: VideoOptions, total_frames: int, video_fps: float, factor: int = 2, label: str = "video"
) -> int:
    """How many of `total_frames` (those of the selected span) to take: a multiple of `factor`."""
    where = "in the video" if options.video_start is None and options.video_end is None else "in the selected span"
    if options.nframes is not None:
        nframes = round(options.nframes / factor) * factor
        if nframes < factor or nframes > total_frames:
            raise MediaError(
                f"{label}: nframes={options.nframes} (rounded to {nframes}) must be between {factor} and "
                f"{total_frames}, the frames {where}"
            )
        return nframes
    fps = options.fps if options.fps is not None else DEFAULT_FPS
    min_frames = math.ceil((options.min_frames or FPS_MIN_FRAMES) / factor) * factor
    max_frames = options.max_frames if options.max_frames is not None else min(FPS_MAX_FRAMES, total_frames)
    max_frames = math.floor(max_frames / factor) * factor
    wanted = total_frames / video_fps * fps
    nframes = math.floor(min(max(wanted, min_frames), max_frames, total_frames) / factor) * factor
    if nframes < factor:
        if options.max_frames is not None and max_frames < factor:
            raise MediaError(f"{label}: max_frames={options.max_frames} leaves fewer than {factor} frames")
        raise MediaError(f"{label}: there are {total_frames} frame(s) {where}; at least {factor} are needed")
    return nframes


def frame_indices(first: int, last: int, nframes: int) -> list[int]:
    """nframes indices spread evenly over first..last, as the decord and torchcodec readers pick them
    (float32 linspace, rounded half to even)."""
    return [int(i) for i in torch.linspace(first, last, nframes).round().long().tolist()]


# -- what size ----------------------------------------------------------------------------------------


def fit(height: int, width: int, factor: int, min_pixels: float, max_pixels: float) -> tuple[int, int]:
    """qwen-vl-utils' smart_resize. image.smart_resize (transformers') differs in one corner: a side
    under factor / 2 counts here as one factor before the bounds are checked. Where qwen-vl-utils
    would reach a zero side (and fail in its resize) this gives one factor."""
    # image.smart_resize refuses zero sizes, aspect ratios over 200 and min_pixels > max_pixels.
    smart_resize(height, width, factor, math.ceil(min_pixels), math.floor(max_pixels))
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_size(
    height: int, width: int, nframes: int, options: VideoOptions, factor: int = 28, temporal_patch_size: int = 2
) -> tuple[int, int]:
    """(height, width) every frame is resized to (fetch_video's sizing)."""
    if options.resized_height is not None and options.resized_width is not None:
        return fit(
            options.resized_height,
            options.resized_width,
            factor,
            IMAGE_MIN_TOKENS * factor**2,
            IMAGE_MAX_TOKENS * factor**2,
        )
    min_pixels = options.min_pixels if options.min_pixels is not None else VIDEO_MIN_TOKENS * factor**2
    total_pixels = options.total_pixels if options.total_pixels is not None else MODEL_SEQ_LEN * factor * factor * 0.9
    max_pixels = max(
        min(VIDEO_MAX_TOKENS * factor**2, total_pixels / nframes * temporal_patch_size), int(min_pixels * 1.05)
    )
    if options.max_pixels is not None:
        max_pixels = min(options.max_pixels, max_pixels)
    return fit(height, width, factor, min_pixels, max_pixels)


def list_frame_size(height: int, width: int, options: VideoOptions, factor: int = 28) -> tuple[int, int]:
    """The size qwen-vl-utils first gives each frame of a list: it fits them like images, at twice the
    factor (its fetch_video passes the 28-pixel factor where fetch_image expects the patch size).
    frame_size then starts from this size; every frame of a list must arrive at the same one."""
    image_factor = 2 * factor
    if options.resized_height is not None and options.resized_width is not None:
        height, width = options.resized_height, options.resized_width
        min_pixels, max_pixels = IMAGE_MIN_TOKENS * image_factor**2, IMAGE_MAX_TOKENS * image_factor**2
    else:
        min_pixels = options.min_pixels if options.min_pixels is not None else IMAGE_MIN_TOKENS * image_factor**2
        max_pixels = options.max_pixels if options.max_pixels is not None else IMAGE_MAX_TOKENS * image_factor**2
    return fit(height, width, image_factor, min_pixels, max_pixels)


# -- opening: everything but the pixels ----------------------------------------------------------------


@dataclass(frozen=True)
class VideoPlan:
    """A video opened and measured, no frame converted yet: which frames it gives and their size, so
    its token count is known before the pixel work."""

    label: str
    frame_indices: tuple[int, ...]  # of the source's frames, one per frame the model sees
    sample_fps: float
    original_size: tuple[int, int]  # (width, height)
    resized_size: tuple[int, int]  # (width, height)
    grid_thw: tuple[int, int, int]
    second_per_grid_t: float
    options: VideoOptions
    source: ContainerIndex | tuple[Any, ...]  # a file, or a list of frames

    def num_tokens(self, merge_size: int) -> int:
        t, h, w = self.grid_thw
        return t * h * w // merge_size**2


@dataclass(frozen=True)
class ProcessedVideo:
    pixel_values: np.ndarray  # [grid_t * grid_h * grid_w, patch_dim] float32
    grid_thw: tuple[int, int, int]
    original_size: tuple[int, int]  # (width, height) as decoded
    resized_size: tuple[int, int]  # (width, height) the model saw
    content_hash: str
    second_per_grid_t: float  # seconds one temporal patch spans
    frame_indices: tuple[int, ...]
    sample_fps: float


def open_video(
    source: object,
    options: VideoOptions,
    cfg: ImageProcessorConfig,
    label: str = "video",
    limits: MediaLimits = DEFAULT_LIMITS,
) -> VideoPlan:
    """Read and index `source` (a file's bytes are read and demuxed; of a list of frames only the
    first is loaded) and choose its frames and their size."""
    if isinstance(source, np.ndarray):
        if source.ndim != 4 or source.shape[-1] != 3 or source.dtype != np.uint8:
            raise MediaError(
                f"{label}: a video array must be uint8 [frames, height, width, 3], "
                f"got {source.dtype} {list(source.shape)}"
            )
        return _plan_frames(tuple(source), options, cfg, label, limits)
    if isinstance(source, (list, tuple)):
        return _plan_frames(tuple(source), options, cfg, label, limits)
    if not isinstance(source, (str, Path, bytes, bytearray, memoryview)):
        raise MediaError(
            f"{label}: expected a path, URL, bytes, a list of frames or a uint8 array [frames, height, width, 3], "
            f"got {type(source).__name__}"
        )
    if options.sample_fps is not None:
        raise MediaError(f"{label}: sample_fps applies to a list of frames; for a video file use fps or nframes")
    video_limits = dataclasses.replace(limits, max_bytes=limits.max_video_bytes)
    data = read_source(source, label, video_limits, "video")
    if len(data) > limits.max_video_bytes:
        raise MediaError(f"{label}: the video is {len(data)} bytes, over the {limits.max_video_bytes}-byte limit")
    if not data:
        raise MediaError(f"{label}: video data is empty")
    index, width, height, video_fps = index_container(data, label, limits)
    total = index.num_frames
    first, last = frame_range(total, video_fps, options.video_start, options.video_end, label)
    count = last - first + 1
    tp = cfg.temporal_patch_size
    nframes = num_frames(options, count, video_fps, tp, label)
    indices = frame_indices(first, last, nframes)
    sample_fps = nframes / max(count, 1e-6) * video_fps
    return _plan(label, indices, sample_fps, (width, height), (height, width), options, cfg, index)


def _plan_frames(
    frames: tuple[Any, ...], options: VideoOptions, cfg: ImageProcessorConfig, label: str, limits: MediaLimits
) -> VideoPlan:
    if not frames:
        raise MediaError(f"{label}: the list of frames is empty")
    if len(frames) > MAX_LIST_FRAMES:
        raise MediaError(f"{label}: {len(frames)} frames given, at most {MAX_LIST_FRAMES} per video")
    given = [key for key in FILE_ONLY_OPTIONS if getattr(options, key) is not None]
    if given:
        raise MediaError(
            f"{label}: {', '.join(given)} select(s) frames of a video file; a list of frames is used as given "
            "(sample_fps says how many of them make a second)"
        )
    tp = cfg.temporal_patch_size
    nframes = math.ceil(len(frames) / tp) * tp
    indices = list(range(len(frames))) + [len(frames) - 1] * (nframes - len(frames))
    first = _load_frame(frames[0], f"{label} frame 0", limits)
    try:
        start_h, start_w = list_frame_size(first.height, first.width, options, cfg.factor)
    except ValueError as e:
        raise MediaError(f"{label} frame 0: {e}") from None
    sample_fps = options.sample_fps if options.sample_fps is not None else DEFAULT_SAMPLE_FPS
    return _plan(label, indices, sample_fps, first.size, (start_h, start_w), options, cfg, (first, *frames[1:]))


def _plan(
    label: str,
    indices: list[int],
    sample_fps: float,
    original_size: tuple[int, int],
    start_size: tuple[int, int],
    options: VideoOptions,
    cfg: ImageProcessorConfig,
    source: ContainerIndex | tuple[Any, ...],
) -> VideoPlan:
    try:
        height, width = frame_size(*start_size, len(indices), options, cfg.factor, cfg.temporal_patch_size)
    except ValueError as e:
        raise MediaError(f"{label}: {e}") from None
    tp, p = cfg.temporal_patch_size, cfg.patch_size
    return VideoPlan(
        label=label,
        frame_indices=tuple(indices),
        sample_fps=sample_fps,
        original_size=original_size,
        resized_size=(width, height),
        grid_thw=(len(indices) // tp, height // p, width // p),
        second_per_grid_t=tp / sample_fps,
        options=options,
        source=source,
    )


def _load_frame(frame: object, label: str, limits: MediaLimits) -> Image.Image:
    if isinstance(frame, np.ndarray):
        if frame.ndim != 3 or frame.shape[-1] != 3 or frame.dtype != np.uint8:
            raise MediaError(
                f"{label}: a frame array must be uint8 [height, width, 3], got {frame.dtype} {list(frame.shape)}"
            )
        return Image.fromarray(frame, "RGB")
    return load_image(frame, label, limits)


# -- the pixels -----------------------------------------------------------------------------------------


def process_video(plan: VideoPlan, cfg: ImageProcessorConfig, limits: MediaLimits = DEFAULT_LIMITS) -> ProcessedVideo:
    """Decode the planned frames (only those are converted to RGB), resize, normalise and lay out."""
    writer = _PatchWriter(plan, cfg)
    if isinstance(plan.source, ContainerIndex):
        size = plan.resized_size
        frames = decode_frames(plan.source, sorted(set(plan.frame_indices)), lambda im: _resize(im, size), plan.label)
        for i in plan.frame_indices:
            writer.add(frames[i])
    else:
        expected: tuple[int, int] | None = None
        for k, frame in enumerate(plan.source):
            where = f"{plan.label} frame {k}"
            image = frame if k == 0 else _load_frame(frame, where, limits)
            try:
                size = list_frame_size(image.height, image.width, plan.options, cfg.factor)
            except ValueError as e:
                raise MediaError(f"{where}: {e}") from None
            if expected is not None and size != expected:
                raise MediaError(
                    f"{where}: frames must all have one size; this one ({image.width}x{image.height}) would be "
                    f"fitted to {size[1]}x{size[0]}, frame 0 to {expected[1]}x{expected[0]}"
                )
            expected = size
            # qwen-vl-utils fits each frame as an image first (PIL), then resizes the video (torch).
            resized = _resize(_fit_as_image(image, size), plan.resized_size)
            for _ in range(plan.frame_indices.count(k)):
                writer.add(resized)
    pixel_values, content_hash = writer.finish()
    return ProcessedVideo(
        pixel_values=pixel_values,
        grid_thw=plan.grid_thw,
        original_size=plan.original_size,
        resized_size=plan.resized_size,
        content_hash=content_hash,
        second_per_grid_t=plan.second_per_grid_t,
        frame_indices=plan.frame_indices,
        sample_fps=plan.sample_fps,
    )


def load_video(
    source: object,
    options: VideoOptions | None = None,
    cfg: ImageProcessorConfig | None = None,
    label: str = "video",
    limits: MediaLimits = DEFAULT_LIMITS,
) -> ProcessedVideo:
    """open_video then process_video."""
    cfg = cfg or ImageProcessorConfig()
    return process_video(open_video(source, options or VideoOptions(), cfg, label, limits), cfg, limits)


def _resize(image: Image.Image, size: tuple[int, int]) -> np.ndarray:
    """A frame [H, W, 3] uint8 at `size` (width, height), resized as qwen-vl-utils' fetch_video
    resizes video frames: torchvision's resize of a uint8 tensor, which is float32 bicubic
    interpolation with antialias, clamped to 0..255 and rounded. PIL's bicubic filter is the same
    but rounds and clips between its horizontal and vertical passes: on fine detail it is more
    than ten levels away."""
    rgb = to_rgb(image)
    if rgb.size == size:
        return np.asarray(rgb, dtype=np.uint8)
    width, height = size
    frame = torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1)[None].to(torch.float32)
    frame = torch.nn.functional.interpolate(
        frame, size=(height, width), mode="bicubic", align_corners=False, antialias=True
    )
    return frame.clamp_(0, 255).round_().to(torch.uint8)[0].permute(1, 2, 0).contiguous().numpy()


def _fit_as_image(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """A frame of a list at `size` (height, width) as qwen-vl-utils' fetch_image leaves it: PIL's
    bicubic resize (its default filter), before the video's own resize."""
    rgb = to_rgb(image)
    height, width = size
    return rgb if rgb.size == (width, height) else rgb.resize((width, height), resample=Image.Resampling.BICUBIC)


class _PatchWriter:
    """Takes the frames in order and writes each temporal patch's rows once its frames are in, so
    only the output and one patch's frames are held."""

    def __init__(self, plan: VideoPlan, cfg: ImageProcessorConfig) -> None:
        self.cfg = cfg
        self.grid_thw = plan.grid_thw
        t, h, w = plan.grid_thw
        self.out = np.empty((t * h * w, 3 * cfg.temporal_patch_size * cfg.patch_size**2), dtype=np.float32)
        self.lut = normalize_lut(cfg).reshape(-1)  # [3 * 256]: channel c's level v at 256 * c + v
        self.channel_offsets = (np.arange(3, dtype=np.int16) * 256)[:, None, None, None]
        self.pending: list[np.ndarray] = []
        self.done = 0  # temporal patches written
        # The encoder input (frames, sizes, normalisation) and the time per temporal patch, which
        # Qwen2.5-VL's positions depend on: the same key means the same KV.
        self.hash = hashlib.blake2b(digest_size=16)
        self.hash.update(
            repr(("video", len(plan.frame_indices), plan.resized_size, cfg, plan.second_per_grid_t)).encode()
        )

    def add(self, frame: np.ndarray) -> None:
        self.hash.update(frame.tobytes())
        self.pending.append(frame)
        if len(self.pending) == self.cfg.temporal_patch_size:
            self._write(np.stack(self.pending))
            self.pending = []

    def _write(self, frames: np.ndarray) -> None:
        cfg = self.cfg
        _, gh, gw = self.grid_thw
        p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
        assert frames.shape == (tp, gh * p, gw * p, 3)
        # The patch layout on the uint8 pixels (a quarter of the bytes to move), each channel's
        # levels offset by 256 * channel into the flat lookup table.
        layout = frames.reshape(tp, gh // m, m, p, gw // m, m, p, 3).transpose(1, 4, 2, 5, 7, 0, 3, 6)
        levels = layout + self.channel_offsets  # [gh/m, gw/m, m, m, C, tp, p, p] int16
        rows = gh * gw
        target = self.out[self.done * rows : (self.done + 1) * rows]
        np.take(self.lut, levels.reshape(rows, -1), out=target, mode="clip")  # same numbers as the image path
        self.done += 1

    def finish(self) -> tuple[np.ndarray, str]:
        assert self.done == self.grid_thw[0] and not self.pending, "every planned frame is written once"
        return self.out, self.hash.hexdigest()
