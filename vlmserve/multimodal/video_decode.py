"""Reading video files with PyAV, in two passes over the bytes.

The first demuxes without decoding: it counts the frames (one per packet), finds the keyframes
and reads the frame rate, so the frames to take and the token count are known, and the limits
checked, before any decoding. The second decodes only the keyframe-led packet groups that hold
the chosen frames, and converts only those frames to RGB.

Frame i is the one with the i-th smallest presentation timestamp, as decord and torchcodec number
them; a file without distinct timestamps on every packet is decoded whole, frames numbered in
the decoder's output order.
"""

from __future__ import annotations

import bisect
import io
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from vlmserve.multimodal.media import MediaError, MediaLimits

# Demuxers a video may use (FFmpeg names; mov covers mp4, matroska covers webm). Playlists
# (HLS, concat) and other demuxers that open further URLs or files are never tried.
ALLOWED_VIDEO_FORMATS = ("mov", "mp4", "matroska", "webm", "avi", "mpegts")
MAX_FPS = 1000.0


@dataclass(frozen=True)
class ContainerIndex:
    """A video file's bytes and its packet index (demuxed, not decoded)."""

    data: bytes
    num_frames: int  # one per packet
    packet_gop: tuple[int, ...]  # which keyframe-led group each packet (in decode order) belongs to
    # Where every packet has a distinct timestamp: frame i is the one with the i-th smallest pts,
    # and groups can be skipped. Otherwise (None) frames are numbered in the decoder's output order.
    frame_pts: tuple[int, ...] | None
    packet_pts: tuple[int, ...] | None  # decode order
    gop_start_pts: tuple[int, ...] | None  # pts of each group's first packet


def _av() -> Any:
    try:
        import av
    except ImportError:
        raise MediaError("video input needs PyAV (pip install av), which is not installed") from None
    return av


def _open_container(data: bytes) -> Any:
    av = _av()
    return av.open(io.BytesIO(data), mode="r", options={"format_whitelist": ",".join(ALLOWED_VIDEO_FORMATS)})


def index_container(data: bytes, label: str, limits: MediaLimits) -> tuple[ContainerIndex, int, int, float]:
    """Demux (no decoding) to count the frames and find the keyframes: (index, width, height, fps)."""
    av = _av()
    packet_pts: list[int | None] = []
    packet_gop: list[int] = []
    gop_start_pts: list[int | None] = []
    try:
        container = _open_container(data)
    except (av.FFmpegError, ValueError, OSError):
        raise MediaError(
            f"{label}: cannot read the video (corrupt, or not one of mp4/mov, mkv/webm, avi, mpeg-ts)"
        ) from None
    try:
        if not container.streams.video:
            raise MediaError(f"{label}: the file holds no video stream")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width <= 0 or height <= 0:
            raise MediaError(f"{label}: the video declares no frame size")
        if width * height > limits.max_image_pixels:
            raise MediaError(
                f"{label}: video frames are {width}x{height} = {width * height} pixels, over the "
                f"{limits.max_image_pixels} limit"
            )
        rate = stream.average_rate or stream.guessed_rate
        time_base = stream.time_base
        for packet in container.demux(stream):
            if packet.size == 0:  # the demuxer's end-of-stream marker
                continue
            if packet.is_keyframe or not gop_start_pts:
                gop_start_pts.append(packet.pts)
            packet_pts.append(packet.pts)
            packet_gop.append(len(gop_start_pts) - 1)
            if len(packet_pts) > limits.max_video_frames:
                raise MediaError(f"{label}: the video holds more than {limits.max_video_frames} frames")
    except av.FFmpegError:
        raise MediaError(f"{label}: the video data is truncated or corrupt") from None
    finally:
        container.close()
    total = len(packet_pts)
    if total == 0:
        raise MediaError(f"{label}: the video holds no frames")
    known = sorted(p for p in packet_pts if p is not None)
    timed = len(known) == total and len(set(known)) == total
    if not rate and time_base and len(known) > 1 and known[-1] > known[0]:
        rate = (len(known) - 1) / ((known[-1] - known[0]) * time_base)
    fps = float(rate) if rate else 0.0
    if not 0 < fps <= MAX_FPS:
        raise MediaError(f"{label}: the video declares a frame rate of {fps:g} fps; 0 < fps <= {MAX_FPS:g} is needed")
    if total / fps > limits.max_video_duration_s:
        raise MediaError(
            f"{label}: the video runs {total / fps:.0f}s ({total} frames at {fps:g} fps), over the "
            f"{limits.max_video_duration_s:g}s limit"
        )
    index = ContainerIndex(
        data=data,
        num_frames=total,
        packet_gop=tuple(packet_gop),
        frame_pts=tuple(known) if timed else None,
        packet_pts=tuple(p for p in packet_pts if p is not None) if timed else None,
        gop_start_pts=tuple(p for p in gop_start_pts if p is not None) if timed else None,
    )
    return index, width, height, fps


def _needed_gops(index: ContainerIndex, wanted: list[int]) -> set[int] | None:
    """The packet groups to decode to get frames `wanted`; None: all of them."""
    starts, frame_pts, packet_pts = index.gop_start_pts, index.frame_pts, index.packet_pts
    if starts is None or frame_pts is None or packet_pts is None:
        return None
    if any(a >= b for a, b in itertools.pairwise(starts)):
        return None
    gop_of_pts = dict(zip(packet_pts, index.packet_gop, strict=True))
    needed: set[int] = set()
    for frame in wanted:
        pts = frame_pts[frame]
        # From the last keyframe shown before the frame to the group it is decoded in (a frame
        # shown before its group's keyframe, in an open GOP, needs the previous group too).
        first = max(0, bisect.bisect_right(starts, pts) - 1)
        needed.update(range(min(first, gop_of_pts[pts]), gop_of_pts[pts] + 1))
    return needed


def decode_frames(
    index: ContainerIndex, wanted: list[int], convert: Callable[[Image.Image], np.ndarray], label: str
) -> dict[int, np.ndarray]:
    """Frames `wanted` (sorted frame numbers), each passed through `convert` (the resize) as soon as
    it is decoded, so no decoded frame is held at its full size."""
    frames: dict[int, np.ndarray] = {}
    for by_pts in (True, False) if index.frame_pts is not None else (False,):
        frames = _decode_pass(index, wanted, by_pts, convert)
        if len(frames) == len(wanted):
            return frames
    missing = next(i for i in wanted if i not in frames)
    raise MediaError(f"{label}: frame {missing} of the video could not be decoded (truncated or corrupt)")


def _decode_pass(
    index: ContainerIndex, wanted: list[int], by_pts: bool, convert: Callable[[Image.Image], np.ndarray]
) -> dict[int, np.ndarray]:
    """Decode the groups holding `wanted` frames (every group when frames are numbered in output
    order), skipping the others undecoded; only wanted frames are converted to RGB."""
    av = _av()
    needed = _needed_gops(index, wanted) if by_pts else None
    number_of = {pts: i for i, pts in enumerate(index.frame_pts or ())} if by_pts else {}
    want = set(wanted)
    out: dict[int, np.ndarray] = {}
    shown = 0  # frames the decoder gave, in output order

    def keep(frames: list[Any]) -> None:
        nonlocal shown
        for frame in frames:
            i = number_of.get(frame.pts) if by_pts else shown
            shown += 1
            if i in want and i not in out:
                out[i] = convert(frame.to_image())  # the only conversion to RGB

    container = _open_container(index.data)
    try:
        stream = container.streams.video[0]
        decoder = stream.codec_context
        skipping = True  # nothing sent to the decoder yet
        packets = (packet for packet in container.demux(stream) if packet.size)
        for k, packet in enumerate(packets):
            if k >= index.num_frames:
                break
            if needed is not None and index.packet_gop[k] not in needed:
                if not skipping:  # drain what the decoder holds, then start afresh at a keyframe
                    keep(_decode(decoder, None, av))
                    decoder.flush_buffers()
                    skipping = True
                continue
            skipping = False
            keep(_decode(decoder, packet, av))
            if len(out) == len(want):
                return out
        if not skipping:
            keep(_decode(decoder, None, av))
    except av.FFmpegError:
        pass  # whatever was decoded counts; missing frames are reported by the caller
    finally:
        container.close()
    return out


def _decode(decoder: Any, packet: Any, av: Any) -> list[Any]:
    try:
        return list(decoder.decode(packet))
    except av.InvalidDataError:  # one damaged packet: go on with the next
        return []
