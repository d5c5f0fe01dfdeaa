"""Video prompts through the offline API, against transformers' generate on the same frames."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import random_image, video_frame, write_video
from tests.entrypoints.test_llm import chat_prompt
from tests.reference import hf_mm_greedy, hf_mm_logits, hf_mm_prompt_ids
from vlmserve import LLM, SamplingParams
from vlmserve.multimodal.video import VideoOptions
from vlmserve.processor.base import ImageInput, VideoInput

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
MAX_NEW = 16
# 8 of the clip's 16 frames at their own 168 x 112: grid (4, 8, 12), 96 tokens; its 4 temporal
# positions stay below max(h, w) / 2 = 6, where transformers and we resume text alike.
KWARGS = {"nframes": 8, "min_pixels": 3136, "max_pixels": 168 * 112}
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    return LLM(
        tiny_dir,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=8,
        kv_cache_memory_gib=0.02,
        limit_mm_per_prompt={"image": 2, "video": 2},
    )


@pytest.fixture(scope="module")
def clip() -> bytes:
    return write_video(16, fps=8, width=168, height=112)


@pytest.fixture(scope="module")
def picture() -> Image.Image:
    return random_image(112, 84, seed=5)  # the same 112 x 84 under our kwargs and transformers' defaults


@pytest.fixture(scope="module")
def prompts(clip: bytes, picture: Image.Image) -> list[Any]:
    return [
        {"prompt": chat_prompt(f"{IMAGE}Describe this."), "multi_modal_data": {"image": picture}},
        {
            "prompt": chat_prompt(f"{VIDEO}What happens in the video?"),
            "multi_modal_data": {"video": clip},
            "mm_processor_kwargs": KWARGS,
        },
        chat_prompt("Tell me about lighthouses."),
        {
            "prompt": chat_prompt(f"Picture: {IMAGE} video: {VIDEO} - which came first?"),
            "multi_modal_data": {"image": [picture], "video": [clip]},
            "mm_processor_kwargs": KWARGS,
        },
    ]


@pytest.fixture(scope="module")
def alone(llm: LLM, prompts: list[Any]) -> list[list[int]]:
    return [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]


def test_batch_equals_each_prompt_alone(llm: LLM, prompts: list[Any], alone: list[list[int]]) -> None:
    outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == alone
    assert len({tuple(tokens) for tokens in alone}) >= 3  # the prompts really differ (random weights repeat a lot)
    assert [o.num_image_tokens for o in outputs] == [[12], [96], [], [12, 96]]  # placeholder tokens per item
    engine = llm.llm_engine
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks and not engine.has_unfinished_requests()


def test_video_prompts_match_transformers(  # type: ignore[no-untyped-def]
    llm: LLM,
    prompts: list[Any],
    alone: list[list[int]],
    clip: bytes,
    picture: Image.Image,
    hf_model,
    hf_tokenizer,
    hf_image_processor,
) -> None:
    processor = llm.llm_engine.processor
    for k in (1, 3):
        text = prompts[k]["prompt"]
        pictures = [picture] if k == 3 else []
        ours = processor.process(text, [ImageInput(p) for p in pictures], [VideoInput(clip, VideoOptions(**KWARGS))])
        (video,) = [item for item in ours.mm_items if item.modality == "video"]
        assert video.grid_thw == (4, 8, 12) and video.second_per_grid_t == 0.5
        # transformers gets the same frames' patches (its video processor needs torchvision).
        media = [*pictures, (video.pixel_values, video.grid_thw, video.second_per_grid_t)]
        ids, vision = hf_mm_prompt_ids(hf_tokenizer, hf_image_processor, text, media)
        del vision["second_per_grid_ts"]  # Qwen2-VL spaces video frames by one position, not by time
        assert ids == ours.prompt_token_ids
        assert hf_mm_greedy(hf_model, ids, vision, MAX_NEW) == alone[k]
        # Random weights repeat tokens: every step's distribution is the sharper check. Teacher
        # forcing the greedy answer gives transformers' distribution at each generated position.
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5)
        out = llm.generate(prompts[k], params)[0].outputs[0]
        assert out.token_ids == alone[k] and out.logprobs is not None
        logits = hf_mm_logits(hf_model, ids + alone[k][:-1], vision)[len(ids) - 1 :]
        reference = torch.log_softmax(logits.double(), dim=-1)
        assert len(out.logprobs) == len(reference) == len(alone[k])
        for top, ref in zip(out.logprobs, reference, strict=True):
            assert sorted(top) == sorted(ref.topk(5).indices.tolist())
            assert all(abs(lp.logprob - float(ref[token_id])) < 1e-4 for token_id, lp in top.items())


def test_chat_and_every_video_form_give_the_same_answer(llm: LLM, clip: bytes, tmp_path: Path) -> None:
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    question = "What happens in the video?"
    expected = (
        llm.generate(
            {
                "prompt": chat_prompt(f"{VIDEO}{question}"),
                "multi_modal_data": {"video": clip},
                "mm_processor_kwargs": KWARGS,
            },
            GREEDY,
        )[0]
        .outputs[0]
        .token_ids
    )
    for source in (str(path), path.as_uri()):
        conversation = [
            {
                "role": "user",
                "content": [{"type": "video", "video": source, **KWARGS}, {"type": "text", "text": question}],
            }
        ]
        assert llm.chat(conversation, GREEDY)[0].outputs[0].token_ids == expected
    openai = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": path.as_uri(), **KWARGS}},
                {"type": "text", "text": question},
            ],
        }
    ]
    assert llm.chat(openai, GREEDY)[0].outputs[0].token_ids == expected
    # Frames as a list, an array or a list of videos: one video each way.
    frames = [video_frame(i, 56, 56) for i in range(4)]
    small = {"min_pixels": 3136, "max_pixels": 3136}
    answers = [
        llm.generate(
            {
                "prompt": chat_prompt(f"{VIDEO}{question}"),
                "multi_modal_data": {"video": data},
                "mm_processor_kwargs": small,
            },
            GREEDY,
        )[0]
        for data in (frames, np.stack(frames), [Image.fromarray(f) for f in frames], [frames])
    ]
    assert len({tuple(a.outputs[0].token_ids) for a in answers}) == 1
    assert {tuple(a.num_image_tokens) for a in answers} == {(8,)}


def test_bad_videos_are_named_and_the_llm_keeps_serving(llm: LLM, prompts: list[Any], alone: list[list[int]]) -> None:
    video_prompt = prompts[1]
    bad_prompts = [
        (
            {**video_prompt, "multi_modal_data": {"video": "/missing/clip.mp4"}},
            r"prompts\[1\].multi_modal_data.video\[0\]: file not found",
        ),
        (
            {**video_prompt, "mm_processor_kwargs": {"fps": 1, "nframes": 4}},
            r"prompts\[1\].mm_processor_kwargs: give fps or nframes",
        ),
        ({**video_prompt, "mm_processor_kwargs": {"fps": "1"}}, "fps must be a positive number"),
        ({**video_prompt, "mm_processor_kwargs": {"frames": 4}}, r"mm_processor_kwargs: unknown keys \['frames'\]"),
        ({**video_prompt, "multi_modal_data": {"video": b"not a video"}}, r"video\[0\]: cannot read the video"),
        ({**video_prompt, "multi_modal_data": {"video": 7}}, r"video\[0\]: expected a path, URL, bytes"),
        (
            {**video_prompt, "multi_modal_data": {"video": [video_prompt["multi_modal_data"]["video"]] * 3}},
            r"prompts\[1\]: too many videos: 3 given, at most 2 per prompt",
        ),
        ({"prompt": chat_prompt(VIDEO)}, r"prompts\[1\]: the prompt holds 1 <\|video_pad\|> placeholder\(s\) but 0"),
    ]
    for bad, message in bad_prompts:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompts[2], bad], GREEDY)
        engine = llm.llm_engine
        assert engine.kv.pool.num_free == engine.kv.pool.num_blocks and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"conversations\[1\].messages\[0\].content\[0\] \(video 1\): file not found"):
        llm.chat(
            [
                [{"role": "user", "content": "hi"}],
                [{"role": "user", "content": [{"type": "video", "video": "/nope.mp4"}]}],
            ]
        )
    assert llm.generate(video_prompt, GREEDY)[0].outputs[0].token_ids == alone[1]


# -- Qwen2.5-VL: the same prompts, absolute-time positions ---------------------------------------


@pytest.fixture(scope="module")
def llm25(tiny25_dir: Path) -> LLM:
    return LLM(
        tiny25_dir,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=8,
        kv_cache_memory_gib=0.02,
        limit_mm_per_prompt={"image": 2, "video": 2},
    )


def test_qwen2_5_vl_mixed_batch_equals_each_alone_and_transformers(  # type: ignore[no-untyped-def]
    llm25: LLM, prompts: list[Any], clip: bytes, picture: Image.Image, tiny25_dir: Path, hf25_model
) -> None:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    alone = [llm25.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    together = llm25.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert len({tuple(tokens) for tokens in alone}) >= 3

    tokenizer = AutoTokenizer.from_pretrained(str(tiny25_dir))
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(tiny25_dir))
    processor = llm25.llm_engine.processor
    for k in (1, 3):
        text = prompts[k]["prompt"]
        pictures = [picture] if k == 3 else []
        ours = processor.process(text, [ImageInput(p) for p in pictures], [VideoInput(clip, VideoOptions(**KWARGS))])
        (video,) = [item for item in ours.mm_items if item.modality == "video"]
        media = [*pictures, (video.pixel_values, video.grid_thw, video.second_per_grid_t)]
        ids, vision = hf_mm_prompt_ids(tokenizer, image_processor, text, media)
        assert ids == ours.prompt_token_ids
        # tokens_per_second 2 x 0.5 s per temporal patch: one position per patch, as transformers.
        assert hf_mm_greedy(hf25_model, ids, vision, MAX_NEW) == alone[k]
    engine = llm25.llm_engine
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_qwen2_5_vl_video_through_token_handles_answers_as_chat(llm25: LLM, tmp_path: Path) -> None:
    """The list-of-dicts input for a video: the ids from LLM.tokenize (handle, grid and seconds per temporal patch
    in the video's first placeholders) give the chat's tokens and logprobs, absolute-time
    positions included (0.625 s per patch, not the default 1 s), and free their segment."""
    from tests.api.conftest import segments_left

    clip = tmp_path / "clip.mp4"
    clip.write_bytes(write_video(10, fps=8, width=168, height=112))  # 4 frames at 3.2 fps
    inputs: list[dict[str, Any]] = [{"video": str(clip)}, {"text": "What happens in the video?"}]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3)
    expected = llm25.chat([{"role": "user", "content": [{"type": "video", "video": str(clip)}, inputs[1]]}], params)[0]
    ids = llm25.tokenize(inputs)
    assert sum(t >= 1 << 61 for t in ids) == 3 and len(segments_left()) == 1
    out = llm25.generate({"prompt_token_ids": ids}, params)[0]
    assert segments_left() == []
    assert out.prompt_token_ids == expected.prompt_token_ids
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert out.outputs[0].logprobs == expected.outputs[0].logprobs
