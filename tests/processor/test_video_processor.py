"""Video prompts through the processor: placeholder expansion, items, M-RoPE positions, chat parts."""

from __future__ import annotations

import base64
import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from tests.conftest import random_image, video_frame, write_video
from tests.reference import hf_mm_prompt_ids, mm_token_type_ids
from vlmserve.families.qwen2_vl.processor import Qwen2VLProcessor, VideoInput
from vlmserve.model_files import read_json
from vlmserve.multimodal.image import ImageProcessorConfig
from vlmserve.multimodal.media import MediaError
from vlmserve.multimodal.video import VideoOptions
from vlmserve.processor.base import ImageInput, ProcessorLimits
from vlmserve.processor.chat import parse_chat_messages
from vlmserve.registry import load_model_config
from vlmserve.tokenizer import Tokenizer

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE_ID, VIDEO_ID = 151655, 151656
# 8 of 16 frames of 168 x 112 at their own size: grid (4, 8, 12), 4 x 4 x 6 = 96 tokens.
CLIP = VideoOptions(nframes=8, min_pixels=3136, max_pixels=168 * 112)


def make_processor(
    tiny_dir: Path,
    max_model_len: int = 32768,
    limits: dict[str, int] | None = None,
    image_max_pixels: int | None = None,
    **vision: Any,
) -> Qwen2VLProcessor:
    config = load_model_config(tiny_dir / "config.json")
    if vision:
        config = dataclasses.replace(config, vision=dataclasses.replace(config.vision, **vision))
    preprocessor = read_json(tiny_dir / "preprocessor_config.json")
    if image_max_pixels is not None:
        preprocessor["max_pixels"] = image_max_pixels
    return Qwen2VLProcessor(
        config,
        Tokenizer(tiny_dir),
        ImageProcessorConfig.from_dict(preprocessor),
        ProcessorLimits(max_model_len, limits if limits is not None else {"image": 4, "video": 2}),
    )


@pytest.fixture(scope="module")
def clip() -> bytes:
    return write_video(16, fps=8, width=168, height=112)


@pytest.fixture(scope="module")
def other_clip() -> bytes:
    return write_video(30, fps=10, width=112, height=84, codec="libx264", container="matroska")


def test_video_prompt_matches_transformers(
    tiny_dir: Path, clip: bytes, hf_tokenizer, hf_image_processor, hf_model
) -> None:  # type: ignore[no-untyped-def]
    processor = make_processor(tiny_dir)
    picture = random_image(150, 100, seed=1)
    cases = [
        (f"{VIDEO}What happens?", []),
        (f"Look: {IMAGE} then {VIDEO} - same scene?", [picture]),
        (f"{VIDEO}{IMAGE}{VIDEO} compare", [picture]),
    ]
    for text, pictures in cases:
        videos = [VideoInput(clip, CLIP, f"video {k}") for k in range(text.count(VIDEO))]
        ours = processor.process(text, [ImageInput(p) for p in pictures], videos)
        video_items = [item for item in ours.mm_items if item.modality == "video"]
        assert [item.grid_thw for item in video_items] == [(4, 8, 12)] * len(videos)
        # 8 of 16 frames at 8 fps: 4 frames a second, 0.5 s per temporal patch.
        assert all(item.length == 96 and item.second_per_grid_t == 0.5 for item in video_items)
        # transformers gets our frames' patches (its video processor needs torchvision).
        next_picture = iter(pictures)
        media = [
            next(next_picture) if item.modality == "image" else (item.pixel_values, item.grid_thw, 0.5)
            for item in ours.mm_items
        ]
        ids, vision = hf_mm_prompt_ids(hf_tokenizer, hf_image_processor, text, media)
        assert ours.prompt_token_ids == ids
        positions, delta = hf_model.model.get_rope_index(
            torch.tensor([ids]),
            mm_token_type_ids(torch.tensor([ids])),
            vision.get("image_grid_thw"),
            vision["video_grid_thw"],
        )
        assert torch.equal(ours.mrope_positions, positions[:, 0])
        assert ours.mrope_delta == int(delta)
        for item in ours.mm_items:  # each item covers exactly its run of placeholders
            pad = VIDEO_ID if item.modality == "video" else IMAGE_ID
            assert set(ours.prompt_token_ids[item.offset : item.end]) == {pad}
            assert ours.prompt_token_ids[item.offset - 1] == 151652 and ours.prompt_token_ids[item.end] == 151653


def test_positions_step_by_temporal_patch_or_by_time(tiny_dir: Path) -> None:
    frames = [video_frame(i, 56, 56) for i in range(6)]  # 3 temporal patches of 2 x 2 merged tokens
    options = VideoOptions(min_pixels=3136, max_pixels=3136, sample_fps=1.0)  # 2 s per temporal patch
    text = f"ab{VIDEO}c"
    for tokens_per_second, temporal in ((None, [0, 1, 2]), (25.0, [0, 50, 100])):
        processor = make_processor(tiny_dir, tokens_per_second=tokens_per_second)
        prompt = processor.process(text, [], [VideoInput(frames, options)])
        (item,) = prompt.mm_items
        assert item.grid_thw == (3, 4, 4) and item.length == 12 and item.second_per_grid_t == 2.0
        start = item.offset  # "ab<|vision_start|>" before it
        assert prompt.mrope_positions[:, item.offset : item.end].tolist() == [
            [start + t for t in temporal for _ in range(4)],
            [start + h for _ in temporal for h in (0, 0, 1, 1)],
            [start + w for _ in temporal for w in (0, 1, 0, 1)],
        ]
        after = start + max(temporal) + 1
        assert prompt.mrope_positions[:, item.end].tolist() == [after] * 3  # <|vision_end|>
        assert prompt.mrope_delta == after + 2 - prompt.num_tokens


def test_images_and_videos_interleave_in_prompt_order(tiny_dir: Path, clip: bytes, other_clip: bytes) -> None:
    processor = make_processor(tiny_dir)
    small = random_image(56, 56, seed=3)
    text = f"A{IMAGE}B{VIDEO}C{IMAGE}{VIDEO}D"
    prompt = processor.process(
        text,
        [ImageInput(small), ImageInput(random_image(112, 56, seed=4))],
        [VideoInput(clip, CLIP), VideoInput(other_clip, VideoOptions(fps=5, min_pixels=3136, max_pixels=112 * 84))],
    )
    assert [item.modality for item in prompt.mm_items] == ["image", "video", "image", "video"]
    assert [item.grid_thw for item in prompt.mm_items] == [(1, 4, 4), (4, 8, 12), (1, 4, 8), (7, 6, 8)]
    assert [item.length for item in prompt.mm_items] == [4, 96, 8, 84]
    # 30 frames at 10 fps, 5 per second: 15 -> 14 frames, sample_fps 14 / 30 * 10.
    assert prompt.mm_items[3].second_per_grid_t == pytest.approx(2 / (14 / 30 * 10))
    assert prompt.num_tokens == len(processor.tokenizer.encode(text)) - 4 + 4 + 96 + 8 + 84
    assert all(a.end < b.offset for a, b in itertools.pairwise(prompt.mm_items))  # text between them
    assert len({item.content_hash for item in prompt.mm_items}) == 4


def test_video_errors_name_the_item(tiny_dir: Path, clip: bytes, tmp_path: Path) -> None:
    processor = make_processor(tiny_dir, max_model_len=256, limits={"video": 1})

    def process(text: str, videos: list[VideoInput]) -> None:
        processor.process(text, [], videos)

    with pytest.raises(MediaError, match="^clip 1: file not found"):
        process(VIDEO, [VideoInput(tmp_path / "nope.mp4", label="clip 1")])
    with pytest.raises(ValueError, match=r"too many videos: 2 given, at most 1 per prompt \(the first one over: b\)"):
        process(VIDEO * 2, [VideoInput(clip, CLIP, "a"), VideoInput(clip, CLIP, "b")])
    with pytest.raises(ValueError, match=r"holds 0 <\|video_pad\|> placeholder\(s\) but 1 video\(s\).*\(a has none\)"):
        process("no placeholder", [VideoInput(clip, CLIP, "a")])
    with pytest.raises(ValueError, match=r"holds 1 <\|video_pad\|> placeholder\(s\) but 0 video\(s\)"):
        process(VIDEO, [])
    with pytest.raises(MediaError, match="^a: there are 1 frame"):
        process(VIDEO, [VideoInput(write_video(1), label="a")])
    with pytest.raises(MediaError, match=r"^a: nframes=20 \(rounded to 20\) must be between 2 and 16"):
        process(VIDEO, [VideoInput(clip, VideoOptions(nframes=20), "a")])
    with pytest.raises(MediaError, match="^a: video_start=3s select"):
        process(VIDEO, [VideoInput(clip, VideoOptions(video_start=3.0), "a")])
    with pytest.raises(ValueError, match=r"prompt needs \d+ tokens \(\d+ text \+ 0 image \+ 192 video\).*=256"):
        process(
            VIDEO + " more words" * 40,
            [VideoInput(clip, VideoOptions(nframes=16, min_pixels=3136, max_pixels=168 * 112), "a")],
        )
    with pytest.raises(MediaError, match=r"^a: the video needs 560 tokens \(4 temporal patches of 140\), at most 255"):
        process(VIDEO, [VideoInput(clip, VideoOptions(nframes=8), "a")])
    wide = make_processor(tiny_dir, image_max_pixels=64 * 28 * 28)  # frames up to 768 tokens, images 64
    with pytest.raises(MediaError, match=r"^a: frames of 4480x2240 need 12800 tokens each, at most 768 are"):
        wide.process(VIDEO, [], [VideoInput(clip, VideoOptions(resized_height=2240, resized_width=4480), "a")])


def test_memory_planning_covers_the_largest_video(tiny_dir: Path) -> None:
    processor = make_processor(tiny_dir, max_model_len=4096, limits={"image": 3})
    assert processor.max_items_per_prompt() == {"image": 3, "video": 1}  # video left out: its default
    assert processor.max_tokens_per_item() == {"image": 4095, "video": 4095}
    assert processor.max_video_frame_tokens() == 4095
    (video,) = processor.dummy_items(1, 1000, "video")
    t, h, w = video.grid_thw
    assert video.modality == "video" and video.length == t * h * w // 4 <= 1000
    assert video.pixel_values.shape == (t * h * w, 1176) and video.second_per_grid_t == 1.0
    small = make_processor(tiny_dir, max_model_len=4096, image_max_pixels=64 * 28 * 28)
    assert small.max_video_frame_tokens() == 768  # qwen-vl-utils' largest default frame, over the image cap
    (video,) = small.dummy_items(1, 4000, "video")
    assert video.grid_thw[1] * video.grid_thw[2] // 4 <= 768 and video.grid_thw[0] == 4000 // 768


# -- chat parts -------------------------------------------------------------------------------------------


def test_chat_video_parts_in_both_shapes(tiny_dir: Path, clip: bytes) -> None:
    url = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    frames = [Image.fromarray(video_frame(i, 56, 56)) for i in range(4)]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": url, "nframes": 8, "min_pixels": 3136, "max_pixels": 168 * 112},
                {"type": "text", "text": "and"},
                {"type": "video_url", "video_url": {"url": url, "fps": 4, "min_pixels": 3136}, "max_pixels": 18816},
                {"type": "video", "video": frames, "sample_fps": 1, "min_pixels": 3136, "max_pixels": 3136},
                {"text": "?"},
            ],
        }
    ]
    rendered, images, videos = parse_chat_messages(messages)
    assert images == [] and [part["type"] for part in rendered[0]["content"]] == [
        "video",
        "text",
        "video",
        "video",
        "text",
    ]
    assert [v.label for v in videos] == [f"messages[0].content[{i}] (video {k})" for i, k in ((0, 1), (2, 2), (3, 3))]
    assert videos[0].options == CLIP
    assert videos[1].options == VideoOptions(fps=4, min_pixels=3136, max_pixels=18816)
    assert videos[2].source is frames and videos[2].options.sample_fps == 1
    processor = make_processor(tiny_dir, limits={"video": 3})
    text = processor.tokenizer.apply_chat_template(rendered)
    assert text.count(VIDEO) == 3
    prompt = processor.process(text, images, videos)
    assert [item.grid_thw for item in prompt.mm_items] == [(4, 8, 12), (4, 8, 12), (2, 4, 4)]
    assert prompt.mm_items[0].content_hash == prompt.mm_items[1].content_hash  # the same 8 frames, same size


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "video"}, r"\(video 1\): video part has no video, URL or frames"),
        ({"type": "video", "video": []}, "has no video, URL or frames"),
        ({"type": "video_url", "video_url": {}}, "has no video, URL or frames"),
        ({"type": "video", "video": "a.mp4", "fps": 1, "nframes": 4}, "give fps or nframes, not both"),
        ({"type": "video", "video": "a.mp4", "fps": "fast"}, "fps must be a positive number up to 1e\\+12, got 'fast'"),
        ({"video": "a.mp4", "video_start": 3, "video_end": 1}, r"video_start \(3s\) must be before video_end \(1s\)"),
    ],
)
def test_bad_video_parts(part: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_chat_messages([{"role": "user", "content": [part]}])
