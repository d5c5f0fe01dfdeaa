"""Issue 13, item 7 (per request): what one request may make the server decode and encode.

- The request's total: the items of one prompt can never need more than max_model_len - 1 tokens
  with its text, and that check is made from the images' headers and the videos' indexes, before
  any pixel is decoded; the 400 names each item's count and the total.
- --limit-mm-per-prompt (vLLM's flag and JSON): items per request, by modality.
- --max-video-tokens: one video's tokens (frames x tokens per frame), from the container's index.
- Qwen-VL-Chat: every image's header is held to --max-image-pixels before any image is decoded;
  a large JPEG is decoded at a reduced scale.

Each against the real server: a 400 naming the numbers, a request in flight keeps its tokens,
/health 200, the engine keeps its PID, no /dev/shm segment left.
"""

from __future__ import annotations

import argparse
import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image, ImageFile

from tests.api.conftest import Server, data_url, picture, segments_left, start_server
from tests.api.test_image_budget import _stream_content, huge_png_url
from tests.conftest import write_video
from vlmserve.api.options import add_arguments
from vlmserve.families.qwen2_vl import processor as qwen2_vl_processor
from vlmserve.families.qwen2_vl.processor import Qwen2VLProcessor
from vlmserve.families.qwen_vl import processor as qwen_vl_processor
from vlmserve.families.qwen_vl.processor import DRAFT_MIN_SIDE, QwenVLProcessor
from vlmserve.families.qwen_vl.tokenizer import QwenVLTokenizer
from vlmserve.model_files import read_json
from vlmserve.multimodal import video_decode
from vlmserve.multimodal.image import ImageProcessorConfig
from vlmserve.multimodal.media import DEFAULT_LIMITS, MediaError, MediaLimits
from vlmserve.multimodal.video import VideoOptions
from vlmserve.processor.base import ImageInput, ProcessorLimits, VideoInput
from vlmserve.registry import load_model_config
from vlmserve.tokenizer import Tokenizer

MAX_VIDEO_TOKENS = 512
# 1540 = 55 * 28: 3025 tokens, under the per-image budget (4095 at max_model_len 4096); two of
# them are not.
SIDE, SIDE_TOKENS = 1540, 55 * 55
# write_video(40, 64x48) with nframes=16: 8 temporal patches of 280x392 frames, 140 tokens each.
VIDEO_TOKENS, VIDEO_PATCHES, PATCH_TOKENS = 1120, 8, 140


def png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 60)).save(buf, format="PNG")
    return buf.getvalue()


def png_url(width: int, height: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(width, height)).decode()


@pytest.fixture(scope="module")
def video() -> bytes:
    return write_video(40, fps=24, width=64, height=48)


@pytest.fixture(scope="module")
def request_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # conftest starts it with --limit-images 3: the JSON flag lowers images to 2, videos keep 1.
    s = start_server(
        tiny_dir,
        tmp_path_factory.mktemp("request-budget"),
        "--limit-mm-per-prompt",
        '{"image": 2}',
        "--max-video-tokens",
        str(MAX_VIDEO_TOKENS),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def qwen_vl_server(tiny_qwen_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tiny_qwen_vl_dir, tmp_path_factory.mktemp("qwen-vl-budget"), "--max-image-pixels", "4000000")
    yield s
    s.stop()


def _chat(server: Server, parts: list[dict[str, Any]], max_tokens: int = 4) -> httpx.Response:
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}]
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    return server.post("/v1/chat/completions", body)


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _video(data: bytes, **options: int) -> dict[str, Any]:
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    return {"type": "video_url", "video_url": {"url": url}, **options}


def _error(response: httpx.Response, *needles: str) -> str:
    assert response.status_code == 400, response.text
    message = str(response.json()["error"]["message"])
    for needle in needles:
        assert needle in message, message
    assert "Traceback" not in response.text and 'File "' not in response.text
    return message


def _in_flight_keeps_its_tokens(server: Server, *bad: list[dict[str, Any]]) -> None:
    """While an image request streams, each `bad` request gets 400; the stream's text is what
    it was alone; the engine keeps its PID, /health 200, no segment left."""
    url = data_url(picture(seed=7))
    alone = server.post(
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": [_image(url), {"type": "text", "text": "Describe it."}]}],
            "max_tokens": 16,
            "temperature": 0.0,
            "ignore_eos": True,
        },
    )
    assert alone.status_code == 200, alone.text
    engine = server.engine_pid()
    pieces = _stream_content(server, url)
    got = [next(pieces)]  # the request is in the engine now
    for parts in bad:
        assert _chat(server, parts).status_code == 400
        assert server.health() == 200
    got.extend(pieces)
    assert "".join(got) == alone.json()["choices"][0]["message"]["content"]
    assert server.engine_pid() == engine and server.health() == 200
    assert segments_left() == []


# -- the request's total --------------------------------------------------------------------------


def test_images_each_in_budget_but_too_many_tokens_together_get_400_naming_each(request_server: Server) -> None:
    engine = request_server.engine_pid()
    response = _chat(request_server, [_image(png_url(SIDE, SIDE)), _image(png_url(SIDE, SIDE))])
    _error(
        response,
        f"+ {2 * SIDE_TOKENS} image)",
        "max_model_len=4096",
        f"messages[0].content[0] (image 1): {SIDE_TOKENS}",
        f"messages[0].content[1] (image 2): {SIDE_TOKENS}",
    )
    # One of them alone is answered.
    assert _chat(request_server, [_image(png_url(SIDE, SIDE))]).status_code == 200
    assert request_server.engine_pid() == engine and request_server.health() == 200
    assert segments_left() == []


def _qwen2_vl_processor(tiny_dir: Path, media_limits: MediaLimits = DEFAULT_LIMITS) -> Qwen2VLProcessor:
    return Qwen2VLProcessor(
        load_model_config(tiny_dir / "config.json"),
        Tokenizer(tiny_dir),
        ImageProcessorConfig.from_dict(read_json(tiny_dir / "preprocessor_config.json")),
        ProcessorLimits(4096, {"image": 4, "video": 1}),
        media_limits,
    )


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The size of every image Pillow decodes from a file from now on."""
    sizes: list[tuple[int, int]] = []
    real_load = ImageFile.ImageFile.load

    def counting_load(self: ImageFile.ImageFile):  # type: ignore[no-untyped-def]
        if self.tile:  # not yet decoded (a second load() is a no-op)
            sizes.append(self.size)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    return sizes


IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def test_the_total_is_checked_from_the_headers_before_any_image_is_decoded(
    tiny_dir: Path, loads: list[tuple[int, int]]
) -> None:
    processor = _qwen2_vl_processor(tiny_dir)
    images = [ImageInput(png(SIDE, SIDE), label=f"image {k}") for k in (1, 2)]
    with pytest.raises(ValueError, match=rf"image 1: {SIDE_TOKENS}, image 2: {SIDE_TOKENS}\."):
        processor.process(IMAGE * 2 + "Same?", images)
    assert loads == []


def _closed(image: Image.Image) -> bool:
    try:
        image.im  # noqa: B018 (raises once the image is closed)
    except ValueError:
        return True
    return False


def test_a_request_holds_one_decoded_image_at_a_time(
    tiny_dir: Path, tiny_qwen_vl_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[Image.Image] = []
    held: list[int] = []  # decoded images not yet released, each time one is resized
    real_load = ImageFile.ImageFile.load

    def recording_load(self: ImageFile.ImageFile):  # type: ignore[no-untyped-def]
        if self.tile:
            decoded.append(self)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", recording_load)
    for module, name in ((qwen2_vl_processor, "process_image"), (qwen_vl_processor, "preprocess_image")):
        real = getattr(module, name)

        def counting(*args: Any, real: Any = real) -> Any:
            held.append(sum(not _closed(image) for image in decoded))
            return real(*args)

        monkeypatch.setattr(module, name, counting)
    images = [ImageInput(png(100 + k, 80), label=f"image {k}") for k in range(3)]
    _qwen2_vl_processor(tiny_dir).process(IMAGE * 3 + "Which differ?", images)
    assert held == [1, 1, 1]
    held.clear()
    _qwen_vl_processor(tiny_qwen_vl_dir).process("<img></img>" * 3 + "Which differ?", images)
    assert held == [1, 1, 1]


# -- --limit-mm-per-prompt --------------------------------------------------------------------------


def test_limit_mm_per_prompt_json_lowers_the_image_count_and_leaves_videos_at_their_default(
    request_server: Server, video: bytes
) -> None:
    three = [_image(data_url(picture(seed=k))) for k in range(3)]
    _error(_chat(request_server, three), "too many images: 3 given, at most 2 per request")
    two_videos = [_video(video, nframes=4), _video(video, nframes=4)]
    _error(_chat(request_server, two_videos), "too many videos: 2 given, at most 1 per request")
    assert _chat(request_server, three[:2]).status_code == 200
    assert segments_left() == []


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("image=2", "expected a JSON object"),
        ("[2]", "expected a JSON object"),
        ('{"audio": 1}', "unknown modality 'audio'"),
        ('{"image": -1}', "image: expected a non-negative integer, got -1"),
        ('{"video": true}', "video: expected a non-negative integer, got True"),
        ('{"image": 2.5}', "image: expected a non-negative integer, got 2.5"),
    ],
)
def test_limit_mm_per_prompt_refuses_what_it_cannot_use_naming_it(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--limit-mm-per-prompt", '{"image": 4, "video": 0}']).limit_mm_per_prompt == {
        "image": 4,
        "video": 0,
    }
    with pytest.raises(SystemExit):
        parser.parse_args(["--limit-mm-per-prompt", value])
    assert message in capsys.readouterr().err


# -- videos: the budget from the container's index ------------------------------------------------------


def test_video_over_max_video_tokens_gets_400_naming_its_frames_and_tokens(
    request_server: Server, video: bytes
) -> None:
    engine = request_server.engine_pid()
    _error(
        _chat(request_server, [_video(video, nframes=16)]),
        f"the video needs {VIDEO_TOKENS} tokens ({VIDEO_PATCHES} temporal patches of {PATCH_TOKENS})",
        f"at most {MAX_VIDEO_TOKENS} per video",
        f"max_video_tokens={MAX_VIDEO_TOKENS}",
    )
    # Four frames (2 temporal patches, 280 tokens) are within the budget.
    assert _chat(request_server, [_video(video, nframes=4)]).status_code == 200
    assert request_server.engine_pid() == engine and request_server.health() == 200
    assert segments_left() == []


def test_video_over_budget_is_refused_before_any_frame_is_decoded(
    tiny_dir: Path, video: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[object] = []
    real_decode = video_decode._decode

    def counting(decoder: Any, packet: Any, av: Any) -> list[Any]:
        decoded.append(packet)
        return real_decode(decoder, packet, av)

    monkeypatch.setattr(video_decode, "_decode", counting)
    processor = _qwen2_vl_processor(tiny_dir, MediaLimits(max_video_tokens=MAX_VIDEO_TOKENS))
    clip = VideoInput(video, VideoOptions(nframes=16), label="clip")
    with pytest.raises(MediaError, match=rf"^clip: the video needs {VIDEO_TOKENS} tokens"):
        processor.process(VIDEO, [], [clip])
    assert decoded == []
    # Within max_model_len but not with the text: the request's total, also before decoding.
    with pytest.raises(ValueError, match=rf"\+ 0 image \+ {VIDEO_TOKENS} video\).*clip: {VIDEO_TOKENS}\."):
        _qwen2_vl_processor(tiny_dir).process(VIDEO + " word" * 3000, [], [clip])
    assert decoded == []


def test_requests_in_flight_keep_their_tokens_while_over_budget_requests_are_refused(
    request_server: Server, video: bytes
) -> None:
    _in_flight_keeps_its_tokens(
        request_server,
        [_image(png_url(SIDE, SIDE)), _image(png_url(SIDE, SIDE))],
        [_video(video, nframes=16)],
        [_image(data_url(picture(seed=k))) for k in range(3)],
    )


# -- Qwen-VL-Chat --------------------------------------------------------------------------------------


def test_qwen_vl_image_over_max_image_pixels_gets_400_from_its_header(qwen_vl_server: Server) -> None:
    engine = qwen_vl_server.engine_pid()
    small = _image(data_url(picture(seed=3)))
    _error(
        _chat(qwen_vl_server, [small, _image(huge_png_url())]),
        "(image 2): image is 8192x8192 = 67108864 pixels, over the 4000000 limit",
    )
    assert _chat(qwen_vl_server, [small]).status_code == 200
    assert qwen_vl_server.engine_pid() == engine and qwen_vl_server.health() == 200
    assert segments_left() == []
    _in_flight_keeps_its_tokens(qwen_vl_server, [small, _image(huge_png_url())])


def _qwen_vl_processor(tiny_qwen_vl_dir: Path, max_image_pixels: int = 4_000_000) -> QwenVLProcessor:
    return QwenVLProcessor(
        QwenVLTokenizer(tiny_qwen_vl_dir),
        ProcessorLimits(4096, {"image": 4}),
        MediaLimits(max_image_pixels=max_image_pixels),
    )


def test_qwen_vl_checks_every_header_before_decoding_any_image(
    tiny_qwen_vl_dir: Path, loads: list[tuple[int, int]]
) -> None:
    processor = _qwen_vl_processor(tiny_qwen_vl_dir)
    prompt = "Picture 1: <img></img>\nPicture 2: <img></img>\nSame?"
    images = [ImageInput(png(64, 48), label="small"), ImageInput(png(2001, 2000), label="big")]
    with pytest.raises(MediaError, match=r"^big: image is 2001x2000 = 4002000 pixels, over the 4000000 limit"):
        processor.process(prompt, images)
    assert loads == []


def test_qwen_vl_decodes_a_large_jpeg_at_a_reduced_scale_close_to_the_whole(
    tiny_qwen_vl_dir: Path, loads: list[tuple[int, int]]
) -> None:
    side = 2 * DRAFT_MIN_SIDE  # 3584: decoded at half its size, 1792
    low = Image.radial_gradient("L").resize((side, side)).convert("RGB")
    buf = io.BytesIO()
    low.save(buf, format="JPEG", quality=90)
    processor = _qwen_vl_processor(tiny_qwen_vl_dir, max_image_pixels=side * side)
    prompt = "Picture 1: <img></img>\nWhat is it?"
    (item,) = processor.process(prompt, [ImageInput(buf.getvalue(), label="jpeg")]).mm_items
    assert loads == [(DRAFT_MIN_SIDE, DRAFT_MIN_SIDE)]
    assert item.original_size == (side, side) and item.resized_size == (448, 448)
    # The whole image, decoded and resized as the reference does, is within a few levels of it.
    (whole,) = processor.process(
        prompt, [ImageInput(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"), label="pil")]
    ).mm_items
    std = item.pixel_values.new_tensor((0.26862954, 0.26130258, 0.27577711))[:, None, None]
    levels = ((item.pixel_values - whole.pixel_values) * std * 255).abs()
    assert levels.max() <= 3 and levels.mean() < 0.5
    # A JPEG under 2 x DRAFT_MIN_SIDE per side decodes whole: its pixels are the reference's.
    loads.clear()
    buf = io.BytesIO()
    low.resize((side - 1, side - 1)).save(buf, format="JPEG", quality=90)
    (item,) = processor.process(prompt, [ImageInput(buf.getvalue(), label="jpeg")]).mm_items
    assert loads == [(side - 1, side - 1)]
