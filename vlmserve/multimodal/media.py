"""Load images from what users pass: a path, a file:// / data: / http(s) URL, raw bytes or a PIL image;
and the same references' bytes for videos (vlmserve.multimodal.video decodes them).

Every failure is a `MediaError` (a ValueError) whose message names the item (`label`) and what is
wrong, and never carries decoder internals.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps

# NOTE: every image vlmserve opens has its header's size held to MediaLimits.max_image_pixels
# (open_image) before a pixel is decoded; Pillow's own bomb check (a warning past 89 M pixels, an
# error past twice that) would override that limit either way, so it is off.
Image.MAX_IMAGE_PIXELS = None

# Formats a user may send. Pillow can open many more (EPS runs Ghostscript, FITS, PDF, ...);
# everything outside this list is refused before decoding.
ALLOWED_IMAGE_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP"})


class MediaError(ValueError):
    """A media item could not be used; the message names the item and the reason."""


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int = 50 * 1024 * 1024
    max_image_pixels: int = 8192 * 8192
    # Placeholder tokens one image may need after resizing (--max-image-tokens); None: what the
    # processor's max_pixels and max_model_len give. Checked on the header, before decoding.
    max_image_tokens: int | None = None
    # The same for one video, all its frames (--max-video-tokens); None: what max_model_len gives.
    # Checked on the container's index, before any frame is decoded.
    max_video_tokens: int | None = None
    fetch_timeout_s: float = 10.0
    # None: local paths and file:// URLs are allowed anywhere (the offline API's default);
    # a folder: only files under it.
    allowed_local_media_path: Path | None = None
    allow_local_files: bool = True
    # Videos. The bytes cap replaces max_bytes for a video file, data URL or download; the frame and
    # duration caps are checked on the container's index, before any frame is decoded, and bound the
    # decoding work (frames decoded <= frames held). Each frame is also held to max_image_pixels.
    max_video_bytes: int = 128 * 1024 * 1024
    max_video_frames: int = 36_000  # 20 minutes at 30 fps
    max_video_duration_s: float = 3600.0


DEFAULT_LIMITS = MediaLimits()


def load_image(source: object, label: str = "image", limits: MediaLimits = DEFAULT_LIMITS) -> Image.Image:
    """Open `source` as a PIL image with EXIF orientation applied; pixels are decoded."""
    if isinstance(source, Image.Image):
        return source
    return load_pixels(open_lazily(source, label, limits), label)


def read_source(
    source: str | Path | bytes | bytearray | memoryview, label: str, limits: MediaLimits, kind: str = "image"
) -> bytes:
    """The bytes behind a path, a file:// / data: / http(s) URL, or raw bytes (returned as they are).
    A file, data URL or download is held to limits.max_bytes."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if isinstance(source, Path):
        return _read_local(source, label, limits)
    if not source:
        raise MediaError(f"{label}: empty {kind} reference")
    scheme = source.split(":", 1)[0].lower() if ":" in source[:12] else ""
    if scheme == "data":
        return parse_data_url(source, label, limits)
    if scheme in ("http", "https"):
        return fetch_url(source, label, limits)
    if scheme == "file":
        parsed = urllib.parse.urlparse(source)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(f"{label}: file:// URL with a remote host is not supported")
        return _read_local(Path(urllib.parse.unquote(parsed.path)), label, limits)
    if scheme and len(scheme) > 1:  # "C:" style drive letters are paths, anything longer a scheme
        raise MediaError(f"{label}: unsupported URL scheme {scheme!r}; use a path, file://, data: or http(s)://")
    return _read_local(Path(source), label, limits)


def _read_local(path: Path, label: str, limits: MediaLimits) -> bytes:
    if not limits.allow_local_files:
        raise MediaError(
            f"{label}: local files are not allowed (a server reads them only under --allowed-local-media-path "
            "DIR; the offline LLM under allowed_local_media_path=DIR)"
        )
    resolved = Path(os.path.realpath(path))
    if limits.allowed_local_media_path is not None:
        root = Path(os.path.realpath(limits.allowed_local_media_path))
        if not resolved.is_relative_to(root) or not resolved.is_file():
            # "outside the allowed folder" and "missing" read the same on purpose.
            raise MediaError(f"{label}: file not found or not allowed")
    if not resolved.is_file():
        raise MediaError(f"{label}: file not found: {path}")
    size = resolved.stat().st_size
    if size > limits.max_bytes:
        raise MediaError(f"{label}: file is {size} bytes, over the {limits.max_bytes}-byte limit")
    return resolved.read_bytes()


def parse_data_url(url: str, label: str, limits: MediaLimits = DEFAULT_LIMITS) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError(f"{label}: malformed data URL (no comma)")
    if not header.lower().endswith(";base64"):
        raise MediaError(f"{label}: data URL must be base64-encoded (data:<type>;base64,<data>)")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise MediaError(f"{label}: data URL is over the {limits.max_bytes}-byte limit")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{label}: data URL holds invalid base64") from None
    if not data:
        raise MediaError(f"{label}: data URL is empty")
    return data


def fetch_url(url: str, label: str, limits: MediaLimits = DEFAULT_LIMITS) -> bytes:
    import httpx

    try:
        with (
            httpx.Client(timeout=limits.fetch_timeout_s, follow_redirects=True, max_redirects=5) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code >= 400:
                raise MediaError(f"{label}: fetching the URL returned HTTP {response.status_code}")
            chunks, total = [], 0
            for chunk in response.iter_bytes():
                total += len(chunk)
                if total > limits.max_bytes:
                    raise MediaError(f"{label}: download exceeds the {limits.max_bytes}-byte limit")
                chunks.append(chunk)
    except httpx.TimeoutException:
        raise MediaError(f"{label}: fetching the URL timed out after {limits.fetch_timeout_s}s") from None
    except httpx.HTTPError as e:
        raise MediaError(f"{label}: could not fetch the URL ({type(e).__name__})") from None
    return b"".join(chunks)


def decode_image(data: bytes, label: str, limits: MediaLimits = DEFAULT_LIMITS) -> Image.Image:
    return load_pixels(open_image(data, label, limits), label)


def open_lazily(source: object, label: str = "image", limits: MediaLimits = DEFAULT_LIMITS) -> Image.Image:
    """`source` (not a PIL image) opened with its header read and checked, its pixels not yet
    decoded: oriented_size() tells its size, load_pixels() decodes it."""
    if not isinstance(source, (bytes, bytearray, memoryview, Path, str)):
        raise MediaError(f"{label}: expected a path, URL, bytes or PIL image, got {type(source).__name__}")
    return open_image(read_source(source, label, limits), label, limits)


# EXIF orientations that turn the image by 90 or 270 degrees (exif_transpose swaps its sides).
_TRANSPOSING_ORIENTATIONS = frozenset({5, 6, 7, 8})


def oriented_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) the image will have once load_pixels applies its EXIF orientation, read
    from the header alone (image.getexif() would decode a PNG's pixels to look past them)."""
    width, height = image.size
    orientation = None
    raw = image.info.get("exif")
    if isinstance(raw, bytes) and raw:
        exif = Image.Exif()
        try:
            exif.load(raw)
            orientation = exif.get(0x0112)
        except Exception:  # a malformed EXIF block: exif_transpose finds no orientation in it either
            orientation = None
    return (height, width) if orientation in _TRANSPOSING_ORIENTATIONS else (width, height)


def load_pixels(image: Image.Image, label: str) -> Image.Image:
    """Decode an image from open_lazily / open_image, with the EXIF orientation applied: the
    same object, its pixels decoded (in place: exif_transpose would return a copy even of an
    image it does not turn, twice the memory of a large one)."""
    try:
        image.load()
        # Same orientation handling as transformers' load_image.
        ImageOps.exif_transpose(image, in_place=True)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise MediaError(f"{label}: image data is truncated or corrupt") from None
    return image


def open_image(data: bytes, label: str, limits: MediaLimits = DEFAULT_LIMITS) -> Image.Image:
    """The image header parsed and held to the pixel limit; no pixel decoded yet."""
    if not data:
        raise MediaError(f"{label}: image data is empty")
    try:
        image = Image.open(io.BytesIO(data), formats=sorted(ALLOWED_IMAGE_FORMATS))
    except Image.UnidentifiedImageError:
        raise MediaError(
            f"{label}: cannot decode image (not one of {', '.join(sorted(ALLOWED_IMAGE_FORMATS))})"
        ) from None
    width, height = image.size
    # Checked on the header, before any pixel is decoded.
    if width * height > limits.max_image_pixels:
        raise MediaError(
            f"{label}: image is {width}x{height} = {width * height} pixels, over the {limits.max_image_pixels} limit "
            "(a server's --max-image-pixels)"
        )
    return image
