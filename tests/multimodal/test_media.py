"""Every way a user can hand over an image, and every way it can be wrong."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from tests.conftest import random_image
from vlmserve.multimodal.media import MediaError, MediaLimits, load_image, load_pixels, open_image


def _png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def picture() -> Image.Image:
    return random_image(64, 48, seed=7)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, picture: Image.Image) -> Iterator[str]:
    """A real HTTP server on loopback serving picture.png (and 404 for anything else)."""
    root = tmp_path_factory.mktemp("www")
    (root / "picture.png").write_bytes(_png_bytes(picture))
    (root / "notes.txt").write_text("not an image")

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_every_source_gives_the_same_pixels(tmp_path: Path, picture: Image.Image, served: str) -> None:
    path = tmp_path / "p.png"
    path.write_bytes(_png_bytes(picture))
    data_url = "data:image/png;base64," + base64.b64encode(_png_bytes(picture)).decode()
    sources = [picture, _png_bytes(picture), path, str(path), path.as_uri(), data_url, f"{served}/picture.png"]
    expected = np.asarray(picture)
    for source in sources:
        assert np.array_equal(np.asarray(load_image(source).convert("RGB")), expected), source


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("/no/such/file.png", "file not found"),
        ("ftp://example.com/a.png", "unsupported URL scheme 'ftp'"),
        ("gopher://example.com/a.png", "unsupported URL scheme 'gopher'"),
        ("data:image/png;base64", "no comma"),
        ("data:image/png;base64,@@@not-base64@@@", "invalid base64"),
        ("data:image/png;base64,", "empty"),
        ("data:image/png,rawbytes", "must be base64"),
        (b"definitely not an image", "cannot decode image"),
        (b"", "empty"),
        (12345, "expected a path, URL, bytes or PIL image"),
    ],
)
def test_bad_sources_name_the_item_and_the_reason(source: object, message: str) -> None:
    with pytest.raises(MediaError, match=f"^photo 3: .*{message}"):
        load_image(source, label="photo 3")


def test_truncated_image(picture: Image.Image) -> None:
    data = _png_bytes(picture)
    with pytest.raises(MediaError, match="truncated or corrupt"):
        load_image(data[: len(data) // 2], label="x")


def test_http_errors(served: str) -> None:
    with pytest.raises(MediaError, match="HTTP 404"):
        load_image(f"{served}/missing.png", label="x")
    with pytest.raises(MediaError, match="cannot decode image"):
        load_image(f"{served}/notes.txt", label="x")
    with pytest.raises(MediaError, match="over the 100-byte limit|exceeds the 100-byte limit"):
        load_image(f"{served}/picture.png", label="x", limits=MediaLimits(max_bytes=100))


def test_formats_outside_the_allowlist(picture: Image.Image) -> None:
    buf = io.BytesIO()
    picture.save(buf, format="TIFF")
    with pytest.raises(MediaError, match="cannot decode image"):
        load_image(buf.getvalue(), label="x")


def test_pixel_cap_is_checked_before_decoding() -> None:
    big = Image.new("RGB", (400, 300))
    with pytest.raises(MediaError, match="400x300 = 120000 pixels, over the 100000 limit .*--max-image-pixels"):
        load_image(_png_bytes(big), label="x", limits=MediaLimits(max_image_pixels=100_000))


def test_the_pixel_limit_alone_decides_past_pillows_own_ceiling() -> None:
    """A 200 M-pixel header (past twice Pillow's 89 M bomb ceiling) is refused with its numbers
    under the default limit, and taken (its header) under a limit raised past it."""
    huge = io.BytesIO()
    Image.new("1", (20000, 10000)).save(huge, "PNG")
    with pytest.raises(MediaError, match="20000x10000 = 200000000 pixels, over the 67108864 limit"):
        open_image(huge.getvalue(), "x")
    assert open_image(huge.getvalue(), "x", MediaLimits(max_image_pixels=10**9)).size == (20000, 10000)


def test_local_files_can_be_confined(tmp_path: Path, picture: Image.Image) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    inside = allowed / "a.png"
    inside.write_bytes(_png_bytes(picture))
    outside = tmp_path / "b.png"
    outside.write_bytes(_png_bytes(picture))
    (allowed / "link.png").symlink_to(outside)
    limits = MediaLimits(allowed_local_media_path=allowed)
    assert load_image(str(inside), limits=limits).size == picture.size
    for escape in [str(outside), str(allowed / ".." / "b.png"), str(allowed / "link.png"), "/proc/self/environ"]:
        with pytest.raises(MediaError, match="file not found or not allowed"):
            load_image(escape, limits=limits)
    with pytest.raises(MediaError, match="local files are not allowed .*--allowed-local-media-path"):
        load_image(str(inside), limits=MediaLimits(allow_local_files=False))


def test_load_pixels_decodes_in_place_and_turns_an_exif_rotated_image() -> None:
    """No copy of the decoded pixels (a large image would be held twice); the EXIF rotation is
    applied as transformers' load_image applies it."""
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees
    for orientation in (None, exif):
        buf = io.BytesIO()
        Image.new("RGB", (100, 40), (10, 20, 30)).save(
            buf, format="JPEG", **({"exif": orientation.tobytes()} if orientation else {})
        )
        lazy = open_image(buf.getvalue(), "photo")
        decoded = load_pixels(lazy, "photo")
        assert decoded is lazy
        assert decoded.size == ((40, 100) if orientation else (100, 40))
        assert ImageOps.exif_transpose(Image.open(io.BytesIO(buf.getvalue()))).size == decoded.size
