"""Issue 13, item 7 (per image): an image costs no more than the server allows, and a small file
declaring a huge one is refused from its header, before any pixel is decoded.

- resized_height/resized_width/min_pixels/max_pixels may lower an image's size, never raise it
  above the server's max_pixels: a 400 naming the field and the numbers.
- --max-image-tokens bounds one image's tokens; the count comes from the header (8192x8192 PNG of
  one colour: a few KB), so the refusal costs no decoding (asserted on the processor: no .load()).
- The engine keeps its PID, a request in flight keeps its tokens, no /dev/shm segment is left.
"""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import httpx
import pytest
from PIL import Image, ImageFile

from tests.api.conftest import Server, data_url, picture, segments_left, start_server
from vlmserve.families.qwen2_vl.processor import Qwen2VLProcessor
from vlmserve.model_files import read_json
from vlmserve.multimodal.image import ImageProcessorConfig
from vlmserve.multimodal.media import MediaError, MediaLimits, open_image, oriented_size
from vlmserve.processor.base import ImageInput, ProcessorLimits
from vlmserve.registry import load_model_config
from vlmserve.tokenizer import Tokenizer

MAX_IMAGE_TOKENS = 64
SIDE = 8192
# The tiny checkpoint's max_pixels is 12845056 = 16384 tokens of 28x28: an 8192x8192 image is
# resized down to that.
HUGE_TOKENS = 16384


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


@cache
def huge_png() -> bytes:
    """A valid 8192x8192 RGB PNG of one colour, written row by row (never held decoded): ~200 KB."""
    row = b"\x00" + b"\x80\x20\x10" * SIDE
    compressor = zlib.compressobj(9)
    idat = b"".join(compressor.compress(row) for _ in range(SIDE)) + compressor.flush()
    header = struct.pack(">IIBBBBB", SIDE, SIDE, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def huge_png_url() -> str:
    return "data:image/png;base64," + base64.b64encode(huge_png()).decode()


@pytest.fixture(scope="module")
def budget_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tiny_dir, tmp_path_factory.mktemp("budget"), "--max-image-tokens", str(MAX_IMAGE_TOKENS))
    yield s
    s.stop()


def _image_chat(server: Server, url: str, max_tokens: int = 4, **sizing: int) -> httpx.Response:
    part = {"type": "image_url", "image_url": {"url": url, **sizing}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    return server.post("/v1/chat/completions", body)


def _assert_clean_400(response: httpx.Response, *needles: str) -> str:
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    for needle in needles:
        assert needle in message, message
    assert "Traceback" not in response.text and 'File "' not in response.text
    return str(message)


def test_png_declaring_8192x8192_gets_400_naming_its_token_count_and_the_limit(budget_server: Server) -> None:
    engine = budget_server.engine_pid()
    response = _image_chat(budget_server, huge_png_url())
    _assert_clean_400(response, f"{HUGE_TOKENS} tokens", f"at most {MAX_IMAGE_TOKENS}")
    assert budget_server.engine_pid() == engine
    assert budget_server.health() == 200
    assert segments_left() == []


@pytest.mark.parametrize(
    ("sizing", "field"),
    [
        ({"resized_height": 10**9, "resized_width": 10**9}, "resized_height"),
        ({"resized_height": 28, "resized_width": 10**9}, "resized_width"),
        ({"max_pixels": 10**9}, "max_pixels=1000000000"),
        ({"min_pixels": 10**9}, "min_pixels=1000000000"),
    ],
    ids=["resized-1e9", "resized-width-1e9", "max_pixels-1e9", "min_pixels-1e9"],
)
def test_per_image_size_above_the_servers_max_pixels_gets_400_naming_the_field(
    budget_server: Server, sizing: dict[str, int], field: str
) -> None:
    engine = budget_server.engine_pid()
    response = _image_chat(budget_server, data_url(picture()), **sizing)
    _assert_clean_400(response, field, "max_pixels=12845056")
    assert budget_server.engine_pid() == engine
    assert budget_server.health() == 200
    assert segments_left() == []


def _stream_content(server: Server, url: str) -> Iterator[str]:
    part = {"type": "image_url", "image_url": {"url": url}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, headers=server.headers, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            data = line.removeprefix("data: ")
            if not line.startswith("data: ") or data == "[DONE]":
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            yield from (choice["delta"].get("content") or "" for choice in chunk["choices"])


def test_image_request_in_flight_keeps_its_tokens_while_oversized_images_are_refused(budget_server: Server) -> None:
    url = data_url(picture(seed=5))
    part = {"type": "image_url", "image_url": {"url": url}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}]
    alone = budget_server.post(
        "/v1/chat/completions",
        {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True},
    )
    assert alone.status_code == 200, alone.text
    engine = budget_server.engine_pid()
    pieces = _stream_content(budget_server, url)
    got = [next(pieces)]  # the image request is in the engine now
    assert _image_chat(budget_server, huge_png_url()).status_code == 400
    assert _image_chat(budget_server, url, resized_height=10**9, resized_width=10**9).status_code == 400
    got.extend(pieces)
    assert "".join(got) == alone.json()["choices"][0]["message"]["content"]
    assert budget_server.engine_pid() == engine and budget_server.health() == 200
    assert segments_left() == []


# -- the processor: the refusal comes from the header, before decoding --------------------------


def _processor(tiny_dir: Path, max_image_tokens: int | None) -> Qwen2VLProcessor:
    return Qwen2VLProcessor(
        load_model_config(tiny_dir / "config.json"),
        Tokenizer(tiny_dir),
        ImageProcessorConfig.from_dict(read_json(tiny_dir / "preprocessor_config.json")),
        ProcessorLimits(32768, {"image": 2}),
        MediaLimits(max_image_tokens=max_image_tokens),
    )


PROMPT = "<|vision_start|><|image_pad|><|vision_end|>What is this?"


def test_processor_refuses_huge_png_over_the_token_budget_without_decoding_its_pixels(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[tuple[int, int]] = []
    real_load = ImageFile.ImageFile.load

    def counting_load(self: ImageFile.ImageFile):  # type: ignore[no-untyped-def]
        loads.append(self.size)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    processor = _processor(tiny_dir, MAX_IMAGE_TOKENS)
    with pytest.raises(MediaError, match=rf"needs {HUGE_TOKENS} tokens, at most {MAX_IMAGE_TOKENS} per image"):
        processor.process(PROMPT, [ImageInput(huge_png(), label="the big one")])
    assert (SIDE, SIDE) not in loads
    # A small image still decodes and gets its tokens.
    small = io.BytesIO()
    picture().save(small, format="PNG")
    processed = processor.process(PROMPT, [ImageInput(small.getvalue(), label="small")])
    assert processed.mm_items[0].length <= MAX_IMAGE_TOKENS


def test_oriented_size_swaps_width_and_height_for_a_rotating_exif_orientation_without_decoding() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees
    buf = io.BytesIO()
    Image.new("RGB", (100, 40), (10, 20, 30)).save(buf, format="JPEG", exif=exif.tobytes())
    image = open_image(buf.getvalue(), "rotated")
    assert oriented_size(image) == (40, 100)
    assert image.tile  # header only: nothing decoded yet
