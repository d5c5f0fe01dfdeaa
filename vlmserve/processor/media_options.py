"""Per-request media options, vLLM's two fields, as defaults for every item of the request (an
option a content part gives itself wins):

- `mm_processor_kwargs`: what vLLM passes to the HF processor; for these models the sizing of
  images and videos (min_pixels, max_pixels, resized_height / resized_width) and a video's frame
  choice (fps, nframes, min_frames, max_frames, total_pixels, video_start / video_end), in
  qwen-vl-utils' vocabulary.
- `media_io_kwargs`: what vLLM passes to its media loaders, by modality: video `num_frames` (the
  frames taken from a file) and `fps` (frames per second taken). Images have no loader options.

Each unknown key or wrong value is a ValueError naming the field, e.g. `media_io_kwargs.video.x`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vlmserve.multimodal.image import ImageSizing
from vlmserve.multimodal.video import FILE_ONLY_OPTIONS, OPTION_KEYS, VideoOptions
from vlmserve.processor.base import ImageInput, VideoInput

# `detail` is a content part's own (OpenAI's), not a request-wide option.
IMAGE_KEYS = tuple(f.name for f in dataclasses.fields(ImageSizing) if f.name != "detail")
# vLLM's loader option -> the qwen-vl-utils option it sets.
MEDIA_IO_KEYS: dict[str, dict[str, str]] = {"image": {}, "video": {"num_frames": "nframes", "fps": "fps"}}
_FRAME_CHOICE = ("fps", "nframes")


@dataclass(frozen=True)
class MediaDefaults:
    """The request's options for its images and videos (None: each part's own, or the defaults)."""

    image: dict[str, Any] = field(default_factory=dict)
    video: dict[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.image or self.video)


def _object(value: object, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be an object, got {type(value).__name__}")
    return value


def media_defaults(mm_processor_kwargs: object, media_io_kwargs: object) -> MediaDefaults:
    """Both fields checked and merged; ValueError naming the field and key."""
    video: dict[str, Any] = {}
    image: dict[str, Any] = {}
    if mm_processor_kwargs is not None:
        kwargs = _object(mm_processor_kwargs, "mm_processor_kwargs")
        known = dict.fromkeys((*IMAGE_KEYS, *OPTION_KEYS))
        unknown = sorted(str(k) for k in kwargs if k not in known)
        if unknown:
            raise ValueError(f"mm_processor_kwargs: unknown keys {unknown[:8]}; supported: {', '.join(known)}")
        VideoOptions.from_dict(kwargs, "mm_processor_kwargs")  # every value checked (sizing keys too)
        video.update({k: v for k, v in kwargs.items() if v is not None})
        image.update({k: v for k, v in kwargs.items() if k in IMAGE_KEYS and v is not None})
    if media_io_kwargs is not None:
        for modality, options in _object(media_io_kwargs, "media_io_kwargs").items():
            if modality not in MEDIA_IO_KEYS:
                raise ValueError(
                    f"media_io_kwargs: unknown modality {str(modality)[:40]!r}; supported: {', '.join(MEDIA_IO_KEYS)}"
                )
            options = _object(options, f"media_io_kwargs.{modality}")
            keys = MEDIA_IO_KEYS[modality]
            for key, value in options.items():
                if key not in keys:
                    supported = ", ".join(keys) or "none"
                    raise ValueError(
                        f"media_io_kwargs.{modality}: unknown key {str(key)[:40]!r}; supported: {supported}"
                    )
                if key == "num_frames" and value == -1:
                    raise ValueError(
                        "media_io_kwargs.video.num_frames: -1 (every frame) is not supported; give a count"
                    )
                video[keys[key]] = value
        VideoOptions.from_dict(video, "media_io_kwargs.video")  # values, and fps with nframes
    return MediaDefaults(image, video)


def apply_media_defaults(
    defaults: MediaDefaults, images: list[ImageInput], videos: list[VideoInput]
) -> tuple[list[ImageInput], list[VideoInput]]:
    """Each item with the request's options under its own (a video given as frames takes none of
    the options that choose frames of a file)."""
    if not defaults:
        return images, videos
    out_images = [
        dataclasses.replace(image, sizing=_merged(ImageSizing, defaults.image, image.sizing)) for image in images
    ]
    out_videos = []
    for video in videos:
        base = dict(defaults.video)
        if not isinstance(video.source, (str, bytes)):  # frames given: nothing to choose from a file
            for k in FILE_ONLY_OPTIONS:
                base.pop(k, None)
        if any(getattr(video.options, k) is not None for k in _FRAME_CHOICE):
            for k in _FRAME_CHOICE:  # the part's own frame choice replaces the request's
                base.pop(k, None)
        merged = base | {k: v for k, v in dataclasses.asdict(video.options).items() if v is not None}
        out_videos.append(dataclasses.replace(video, options=VideoOptions.from_dict(merged, video.label)))
    return out_images, out_videos


def _merged(cls: Any, defaults: dict[str, Any], own: Any) -> Any:
    values = dict(defaults) | {k: v for k, v in dataclasses.asdict(own).items() if v is not None}
    return cls(**values)
