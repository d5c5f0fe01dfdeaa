"""Qwen3-VL's videos as transformers 5.23 processes them (Qwen3VLVideoProcessor and
Qwen3VLProcessor), on vlmserve's decoder and patch writer (vlmserve.multimodal.video).

Which frames, for a file: `nframes` evenly spread (transformers' num_frames), or `fps` per second
(default 2): int(frames / video fps * fps), held between min_frames (4) and max_frames (768) and
the frames there are; indices linspace(0, frames - 1, n) rounded half to even; the last frame
repeated to a multiple of the temporal patch (2). A list of frames is used as given (qwen-vl-utils'
rule, vlmserve.multimodal.video), `sample_fps` of them per second.

Their size: one smart_resize for the whole clip, to multiples of 32 pixels with
frames x height x width between the video preprocessor's size.shortest_edge and longest_edge
(4096 and 25165824 published: without transformers' optional per-frame cap, its 5.23 default),
min_pixels / max_pixels replacing them.

In the prompt each temporal patch k gets its own span, after its time in seconds (the mean of its
two frames' times, one decimal): `<0.3 seconds><|vision_start|><|video_pad|> x n<|vision_end|>`,
inside the <|vision_start|>...<|vision_end|> the chat template put around the video. The frames of
a patch take the temporal position of the span's start (t = 1 per span), so each span is one
item: its own grid (1, h, w), its own rows of the video's pixels and a content hash of its own."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from vlmserve.multimodal.image import ImageProcessorConfig
from vlmserve.multimodal.media import DEFAULT_LIMITS, MediaError, MediaLimits, read_source
from vlmserve.multimodal.video import VideoOptions, VideoPlan, open_video
from vlmserve.multimodal.video_decode import index_container

FPS = 2.0
MIN_FRAMES = 4
MAX_FRAMES = 768
# Options of qwen-vl-utils that transformers' Qwen3-VL video processor has no counterpart for.
UNSUPPORTED = ("video_start", "video_end", "total_pixels", "resized_height", "resized_width")


def sample_indices(options: VideoOptions, total: int, video_fps: float) -> list[int]:
    """Frame indices transformers' Qwen3VLVideoProcessor.sample_frames picks."""
    if options.nframes is not None:
        n = options.nframes
    else:
        fps = options.fps if options.fps is not None else FPS
        min_frames = options.min_frames if options.min_frames is not None else MIN_FRAMES
        max_frames = options.max_frames if options.max_frames is not None else MAX_FRAMES
        n = min(max(int(total / video_fps * fps), min_frames), max_frames, total)
    if not 1 <= n <= total:
        raise MediaError(f"nframes={n} must be between 1 and the {total} frames of the video")
    return [int(i) for i in np.linspace(0, total - 1, n).round().astype(int)]


def clip_size(
    num_frames: int, height: int, width: int, factor: int, temporal_factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers' Qwen3-VL video smart_resize: (height, width) for every frame, bounding
    frames x height x width."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} exceeds the limit of 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patch_timestamps(frame_indices: tuple[int, ...], video_fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch: the mean of its first and last frame's times."""
    times = [i / video_fps for i in frame_indices]
    return [(times[k] + times[k + temporal_patch_size - 1]) / 2 for k in range(0, len(times), temporal_patch_size)]


def timestamp_text(seconds: float) -> str:
    return f"<{seconds:.1f} seconds>"


def plan_video(
    source: object, options: VideoOptions, cfg: ImageProcessorConfig, label: str, limits: MediaLimits = DEFAULT_LIMITS
) -> tuple[VideoPlan, float]:
    """The frames and size of a video, and the frames per second its frame indices count in (the
    file's rate; a list of frames: sample_fps, default 2)."""
    if isinstance(source, (list, tuple, np.ndarray)):
        plan = open_video(source, options, cfg, label, limits)
        return plan, plan.sample_fps
    given = [key for key in UNSUPPORTED if getattr(options, key) is not None]
    if given:
        raise MediaError(
            f"{label}: {', '.join(given)} are not options of Qwen3-VL's video processor; use fps or nframes, "
            "min_frames, max_frames, min_pixels and max_pixels"
        )
    if options.sample_fps is not None:
        raise MediaError(f"{label}: sample_fps applies to a list of frames; for a video file use fps or nframes")
    if not isinstance(source, (str, bytes, bytearray, memoryview)) and not hasattr(source, "__fspath__"):
        raise MediaError(f"{label}: expected a path, URL, bytes or a list of frames, got {type(source).__name__}")
    video_limits = dataclasses.replace(limits, max_bytes=limits.max_video_bytes)
    data = read_source(source, label, video_limits, "video")  # type: ignore[arg-type]
    if not data:
        raise MediaError(f"{label}: video data is empty")
    index, width, height, video_fps = index_container(data, label, limits)
    tp = cfg.temporal_patch_size
    try:
        sampled = sample_indices(options, index.num_frames, video_fps)
    except MediaError as e:
        raise MediaError(f"{label}: {e}") from None
    # The clip is sized by the sampled frames, then padded with the last to whole temporal patches.
    indices = sampled + [sampled[-1]] * (-len(sampled) % tp)
    min_pixels = options.min_pixels if options.min_pixels is not None else cfg.min_pixels
    max_pixels = options.max_pixels if options.max_pixels is not None else cfg.max_pixels
    if max_pixels > cfg.max_pixels:
        raise MediaError(f"{label}: max_pixels={max_pixels} exceeds the server's video max_pixels={cfg.max_pixels}")
    try:
        h, w = clip_size(len(sampled), height, width, cfg.factor, tp, min_pixels, max_pixels)
    except ValueError as e:
        raise MediaError(f"{label}: {e}") from None
    p = cfg.patch_size
    plan = VideoPlan(
        label=label,
        frame_indices=tuple(indices),
        sample_fps=len(indices) / max(index.num_frames, 1) * video_fps,
        original_size=(width, height),
        resized_size=(w, h),
        grid_thw=(len(indices) // tp, h // p, w // p),
        second_per_grid_t=tp * index.num_frames / max(len(indices), 1) / video_fps,
        options=options,
        source=index,
    )
    return plan, video_fps
