"""Video through the real server: `video_url` parts (data URLs and downloads through the guarded
fetcher) reach the engine process in shared memory and are answered as the offline engine answers
them (Qwen2-VL, and Qwen2.5-VL whose positions depend on each video's second_per_grid_t, also
against transformers), and BAD_INPUTS 13's videos get a 400 that names the problem, within the
timeout, with nothing leaked and the server still serving."""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from openai.types.chat import ChatCompletion

from tests.api.conftest import Server, data_url, picture, start_server
from tests.api.test_bad_inputs import check_error
from tests.api.upstream import serve
from tests.conftest import write_video
from tests.reference import hf_mm_greedy, hf_mm_logits
from vlmserve import LLM, SamplingParams
from vlmserve.api.frontend import load_frontend
from vlmserve.engine.config import EngineConfig
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


@pytest.fixture(scope="module")
def offline(tiny_dir: Path) -> LLM:
    return LLM(
        tiny_dir,
        dtype="float32",
        max_model_len=4096,
        kv_cache_memory_gib=0.05,
        limit_mm_per_prompt={"image": 3, "video": 1},
    )


# One generated token as the API shows it: its bytes, its logprob, and its top alternatives'
# (bytes, logprob) best first. Equal bytes mean equal token ids (byte-level BPE).
Token = tuple[bytes, float, list[tuple[bytes, float]]]


def served(reply: ChatCompletion) -> list[Token]:
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    content = logprobs.content
    return [(bytes(t.bytes), t.logprob, [(bytes(top.bytes), top.logprob) for top in t.top_logprobs]) for t in content]


def offline_answer(llm: LLM, messages: list[dict], max_tokens: int, k: int = 5) -> tuple[list[Token], list[int]]:
    """The offline engine's greedy answer to the same messages, in the API's shape, and its token ids."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=k)
    out = llm.chat(messages, params)[0].outputs[0]
    assert out.logprobs is not None
    tokenizer = llm.get_tokenizer()
    answer = []
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
        top = [(tokenizer.token_bytes(tid), lp.logprob) for tid, lp in ranked if (lp.rank or 0) <= k]
        answer.append((tokenizer.token_bytes(token_id), entry[token_id].logprob, top))
    return answer, out.token_ids


def assert_same_answer(got: list[Token], expected: list[Token], tol: float = 1e-5) -> None:
    """Same tokens and alternatives, log-probabilities within `tol` (the same float32 code in two
    processes; they may sum in another order)."""
    assert [t[0] for t in got] == [t[0] for t in expected]
    for (_, logprob, top), (_, ref_logprob, ref_top) in zip(got, expected, strict=True):
        assert abs(logprob - ref_logprob) < tol
        assert [b for b, _ in top] == [b for b, _ in ref_top]
        assert all(abs(a - b) < tol for (_, a), (_, b) in zip(top, ref_top, strict=True))


def ask(client: openai.OpenAI, messages: list[dict], max_tokens: int, k: int = 5) -> ChatCompletion:
    return client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=k,
    )


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


def test_a_video_data_url_is_answered_as_offline(client: openai.OpenAI, offline: LLM, tiny_dir: Path) -> None:
    data = write_video(48, fps=24, width=96, height=64)  # 2 s: fps 2 picks 4 frames, 2 temporal patches
    messages = video_message(video_url(data))
    reply = ask(client, messages, 4)
    expected = offline_answer(offline, messages, 4)[0]
    assert_same_answer(served(reply), expected)
    usage = reply.usage.model_extra or {}
    (item,) = usage["multimodal_tokens"]
    assert item["modality"] == "video"
    assert item["original_size"] == [96, 64]
    prompt_ids = expected_tokens(tiny_dir, messages, data)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert item["tokens"] == prompt_ids.count(151656)  # <|video_pad|>
    # The same request again (encoder and prefix caches warm) still gives the offline answer.
    assert_same_answer(served(ask(client, messages, 4)), expected)


def test_options_in_the_part_change_the_frames_taken(client: openai.OpenAI, offline: LLM, tiny_dir: Path) -> None:
    data = write_video(48, fps=24, width=96, height=64)
    messages = video_message(video_url(data), nframes=8)
    reply = ask(client, messages, 1)
    assert_same_answer(served(reply), offline_answer(offline, messages, 1)[0])
    prompt_ids = expected_tokens(tiny_dir, messages, data)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    default = client.chat.completions.create(
        model="tiny", messages=video_message(video_url(data)), max_tokens=1, temperature=0
    )
    # 8 frames are 4 temporal patches, the default 4 frames 2: twice the video tokens.
    video_tokens = [(r.usage.model_extra or {})["multimodal_tokens"][0]["tokens"] for r in (reply, default)]
    assert video_tokens[0] == 2 * video_tokens[1]


def test_images_and_a_video_in_one_request_answered_as_offline(
    client: openai.OpenAI, offline: LLM, tiny_dir: Path
) -> None:
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
    reply = ask(client, messages, 3)
    assert_same_answer(served(reply), offline_answer(offline, messages, 3)[0])
    kinds = [item["modality"] for item in (reply.usage.model_extra or {})["multimodal_tokens"]]
    assert kinds == ["image", "video"]
    assert reply.usage.prompt_tokens == len(expected_tokens(tiny_dir, messages, data, image))


def test_a_video_downloaded_through_the_fetcher_is_answered_as_offline(
    client: openai.OpenAI, offline: LLM, tiny_dir: Path
) -> None:
    data = write_video(24, fps=12, width=64, height=48)
    httpd, hits = serve(png=data)  # serves `data` at /ok.png
    try:
        messages = video_message(f"http://127.0.0.1:{httpd.server_address[1]}/ok.png")
        reply = ask(client, messages, 2)
    finally:
        httpd.shutdown()
    assert hits == ["/ok.png"]
    inline = video_message(video_url(data))
    assert reply.usage.prompt_tokens == len(expected_tokens(tiny_dir, inline, data))
    assert_same_answer(served(reply), offline_answer(offline, inline, 2)[0])


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


# -- Qwen2.5-VL: positions from each video's second_per_grid_t ----------------------------------


@pytest.fixture(scope="module")
def offline25(tiny25_dir: Path) -> LLM:
    return LLM(
        tiny25_dir,
        dtype="float32",
        max_model_len=4096,
        kv_cache_memory_gib=0.05,
        limit_mm_per_prompt={"image": 3, "video": 1},
    )


def test_qwen2_5_vl_video_is_answered_as_offline_and_as_transformers(  # type: ignore[no-untyped-def]
    qwen25_server: Server, offline25: LLM, hf25_model
) -> None:
    # 16 frames at 10 fps, sampled at fps 5: 8 frames, 4 temporal patches 2 / 5 = 0.4 s apart.
    # With tokens_per_second 2 their temporal positions are int(t * 0.8) = 0, 0, 1, 2: neither
    # Qwen2-VL's one per patch (0, 1, 2, 3) nor a default of 1 s (0, 2, 4, 6). All stay below the
    # 6 x 4 merged grid's 6, where transformers and we resume the text alike.
    data = write_video(16, fps=10, width=168, height=112)
    messages = video_message(video_url(data), fps=5, min_pixels=3136, max_pixels=168 * 112)
    processed = offline25.process_chat(messages)
    (video,) = processed.mm_items
    assert video.grid_thw == (4, 8, 12) and video.second_per_grid_t == pytest.approx(0.4)
    tokens = 6
    expected, token_ids = offline_answer(offline25, messages, tokens)

    client = openai.OpenAI(
        base_url=qwen25_server.url + "/v1", api_key=qwen25_server.api_key, max_retries=0, timeout=120
    )
    reply = ask(client, messages, tokens)
    assert_same_answer(served(reply), expected)

    # The offline answer is transformers' on the same patches.
    ids = processed.prompt_token_ids
    vision = {
        "pixel_values_videos": video.pixel_values,
        "video_grid_thw": torch.tensor([video.grid_thw]),
        "second_per_grid_ts": torch.tensor([video.second_per_grid_t]),
    }
    assert hf_mm_greedy(hf25_model, ids, vision, tokens) == token_ids
    tokenizer = offline25.get_tokenizer()
    reference = torch.log_softmax(hf_mm_logits(hf25_model, ids, vision)[-1].double(), dim=-1)
    top = reference.topk(5)
    assert [b for b, _ in expected[0][2]] == [tokenizer.token_bytes(int(i)) for i in top.indices]
    assert all(abs(lp - float(ref)) < 1e-4 for (_, lp), ref in zip(expected[0][2], top.values, strict=True))
    # ...and the check can tell: Qwen2-VL's spacing (0.5 s here) moves the answer past the tolerance.
    vision["second_per_grid_ts"] = torch.tensor([0.5])
    other = torch.log_softmax(hf_mm_logits(hf25_model, ids, vision)[-1].double(), dim=-1)
    assert (other - reference).abs().max() > 1e-3
