"""Video through the real server: `video_url` parts (data URLs and downloads through the guarded
fetcher) reach the engine process in shared memory, and BAD_INPUTS 13's videos get a 400 that
names the problem, within the timeout, with nothing leaked and the server still serving."""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import write_video
from tests.serve.conftest import Server, data_url, picture, start_server
from tests.serve.test_bad_inputs import check_error
from tests.serve.upstream import serve
from vlmserve.engine.config import EngineConfig
from vlmserve.engine.frontend import load_frontend
from vlmserve.processor.base import ImageInput, VideoInput
from vlmserve.processor.chat import parse_chat_messages

MAX_FRAMES = 5000


@pytest.fixture(scope="module")
def video_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        tiny_dir,
        tmp_path_factory.mktemp("video-server"),
        "--max-video-frames",
        str(MAX_FRAMES),
        "--allow-media-network",
        "127.0.0.1/32",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(video_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=video_server.url + "/v1", api_key=video_server.api_key, max_retries=0, timeout=120)


def video_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def video_message(url: str, text: str = "What happens?", **options: object) -> list[dict]:
    part = {"type": "video_url", "video_url": {"url": url}, **options}
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def expected_tokens(tiny_dir: Path, messages: list[dict], data: bytes, image: object = None) -> list[int]:
    """The prompt token ids the processor gives for the same request (no model needed)."""
    frontend = load_frontend(EngineConfig(model=str(tiny_dir), max_model_len=4096))
    rendered, _, videos = parse_chat_messages(messages)
    text = frontend.tokenizer.apply_chat_template(rendered, True)
    images = [ImageInput(image)] if image is not None else []
    return frontend.processor.process(text, images, [VideoInput(data, videos[0].options)]).prompt_token_ids


def test_a_video_data_url_is_answered(client: openai.OpenAI, tiny_dir: Path) -> None:
    data = write_video(48, fps=24, width=96, height=64)  # 2 s: fps 2 picks 4 frames, 2 temporal patches
    messages = video_message(video_url(data))
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    usage = reply.usage.model_extra or {}
    (item,) = usage["multimodal_tokens"]
    assert item["modality"] == "video"
    assert item["original_size"] == [96, 64]
    prompt_ids = expected_tokens(tiny_dir, messages, data)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert item["tokens"] == prompt_ids.count(151656)  # <|video_pad|>
    # The same request again (encoder and prefix caches warm) gives the same greedy answer.
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert again.choices[0].message.content == reply.choices[0].message.content


def test_options_in_the_part_change_the_frames_taken(client: openai.OpenAI, tiny_dir: Path) -> None:
    data = write_video(48, fps=24, width=96, height=64)
    messages = video_message(video_url(data), nframes=8)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0)
    prompt_ids = expected_tokens(tiny_dir, messages, data)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    default = client.chat.completions.create(
        model="tiny", messages=video_message(video_url(data)), max_tokens=1, temperature=0
    )
    # 8 frames are 4 temporal patches, the default 4 frames 2: twice the video tokens.
    video_tokens = [(r.usage.model_extra or {})["multimodal_tokens"][0]["tokens"] for r in (reply, default)]
    assert video_tokens[0] == 2 * video_tokens[1]


def test_images_and_a_video_in_one_request(client: openai.OpenAI, tiny_dir: Path) -> None:
    data = write_video(24, fps=12, width=64, height=64)
    image = picture(3, (90, 60))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "video_url", "video_url": {"url": video_url(data)}},
                {"type": "text", "text": "Compare them."},
            ],
        }
    ]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    kinds = [item["modality"] for item in (reply.usage.model_extra or {})["multimodal_tokens"]]
    assert kinds == ["image", "video"]
    assert reply.usage.prompt_tokens == len(expected_tokens(tiny_dir, messages, data, image))


def test_a_video_downloaded_through_the_fetcher(client: openai.OpenAI, tiny_dir: Path) -> None:
    data = write_video(24, fps=12, width=64, height=48)
    httpd, hits = serve(png=data)  # serves `data` at /ok.png
    try:
        messages = video_message(f"http://127.0.0.1:{httpd.server_address[1]}/ok.png")
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0)
    finally:
        httpd.shutdown()
    assert hits == ["/ok.png"]
    assert reply.usage.prompt_tokens == len(expected_tokens(tiny_dir, video_message(video_url(data)), data))


def test_too_many_videos_are_refused_before_any_fetch(video_server: Server) -> None:
    url = video_url(write_video(8))
    content = [{"type": "video_url", "video_url": {"url": url}}] * 2
    response = video_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}]})
    check_error(video_server, response, 400, "too many videos: 2 given, at most 1")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        # BAD_INPUTS 13: 10,000 frames in a data URL (small frames, a few hundred KB).
        (lambda: write_video(10_000, fps=24, width=16, height=16), f"more than {MAX_FRAMES} frames"),
        (lambda: os.urandom(4096), "cannot read the video"),
        (lambda: write_video(30)[:3000], "truncated or corrupt|cannot read the video|no frames"),
        (lambda: b"", "empty|cannot read the video|no frames"),
        (lambda: write_video(10, fps=5000, container="matroska"), "frame rate of 5000 fps"),
    ],
    ids=["10k-frames", "random-bytes", "truncated", "zero-bytes", "absurd-fps"],
)
def test_bad_videos_get_a_400_and_the_server_goes_on(video_server: Server, make, match: str) -> None:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    response = video_server.post("/v1/chat/completions", {"messages": video_message(video_url(make()))})
    assert time.monotonic() - started < 30
    error = check_error(video_server, response, 400, match)  # also: healthy, no segment left
    assert error["param"] == "messages"
    assert "(video 1)" in error["message"]  # names the item
    ok = video_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200
