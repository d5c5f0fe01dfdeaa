"""Preempted requests that hold images and videos, through the engine on the tiny Qwen2-VL, against
transformers' greedy decoding of each prompt alone.

The KV pool, the step's token budget and the encoder cache are made small enough for the situation
under test to happen, and each test asserts that it did: which request was preempted and where its
last chunk ended (recorded by wrapping Scheduler._preempt), and which images and videos the vision
encoder ran on (recorded by wrapping the model's embed_multimodal)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import random_image, write_video
from tests.entrypoints.test_llm import chat_prompt
from tests.reference import hf_mm_prompt_ids, hf_prompt_ids, mm_token_type_ids
from vlmserve import SamplingParams
from vlmserve.engine.config import EngineConfig
from vlmserve.engine.request import Request
from vlmserve.entrypoints.llm_engine import LLMEngine
from vlmserve.multimodal.inputs import MultiModalItem, ProcessedPrompt
from vlmserve.multimodal.video import VideoOptions
from vlmserve.outputs import RequestOutput
from vlmserve.processor.base import ImageInput, VideoInput

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
KV_BYTES_PER_TOKEN = 512  # the tiny Qwen2-VL in float32
BLOCK_SIZE = 16
# 8 of the clip's 16 frames at their own 168 x 112: 96 placeholder tokens.
VIDEO_OPTIONS = VideoOptions(nframes=8, min_pixels=3136, max_pixels=168 * 112)


def make_engine(
    model_dir: Path, num_blocks: int, budget: int, encoder_cache_tokens: int | None, prefix_caching: bool
) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=512,
            max_num_batched_tokens=budget,
            block_size=BLOCK_SIZE,
            kv_cache_memory_bytes=num_blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN,
            encoder_cache_tokens=encoder_cache_tokens,
            enable_prefix_caching=prefix_caching,
            limit_mm_per_prompt={"image": 2, "video": 1},
        )
    )
    assert engine.kv.pool.num_blocks == num_blocks
    return engine


@dataclass
class Trace:
    encoded: list[str] = field(default_factory=list)  # content hashes, in the order encoded
    preempted: list[tuple[str, int]] = field(default_factory=list)  # (request id, tokens it had computed)


@pytest.fixture
def start_trace(monkeypatch: pytest.MonkeyPatch) -> Callable[[LLMEngine], Trace]:
    """Records, from the call on and until the test ends, an engine's encoder runs and preemptions."""

    def start(engine: LLMEngine) -> Trace:
        trace = Trace()
        embed, preempt = engine.model.embed_multimodal, engine.scheduler._preempt

        def counting_embed(items: list[MultiModalItem]) -> list[torch.Tensor]:
            trace.encoded.extend(item.content_hash for item in items)
            return embed(items)

        def recording_preempt(request: Request) -> None:
            trace.preempted.append((request.request_id, request.num_computed_tokens))
            preempt(request)

        monkeypatch.setattr(engine.model, "embed_multimodal", counting_embed)
        monkeypatch.setattr(engine.scheduler, "_preempt", recording_preempt)
        return trace

    return start


def run(engine: LLMEngine, prompts: dict[str, ProcessedPrompt], max_tokens: int) -> dict[str, RequestOutput]:
    """Add the prompts in order (the first is the oldest) and step until all finish, greedy with
    the top 5 logprobs. A bounded number of steps: a request stuck forever fails the test."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=5)
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    finished: dict[str, RequestOutput] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert not engine.has_unfinished_requests(), "requests still unfinished after 200 steps"
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    return finished


def hf_greedy_with_logprobs(
    hf_model, ids: list[int], vision: dict, max_new: int
) -> tuple[list[int], list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    """transformers' greedy tokens for the prompt alone and, for each, the log-softmax of the
    logits it was picked from."""
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=mm_token_type_ids(input_ids),
            max_new_tokens=max_new,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            **vision,
        )
    return out.sequences[0, len(ids) :].tolist(), [torch.log_softmax(step[0].double(), -1) for step in out.logits]


def assert_same_tokens_and_logprobs(output: RequestOutput, reference: tuple[list[int], list[torch.Tensor]]) -> None:
    """Random weights repeat tokens a lot: the logprobs of every step are the sharper check."""
    tokens, logprobs = reference
    completion = output.outputs[0]
    assert completion.token_ids == tokens
    assert completion.logprobs is not None and len(completion.logprobs) == len(logprobs)
    for step, (entry, ref) in enumerate(zip(completion.logprobs, logprobs, strict=True)):
        worst = max(abs(lp.logprob - float(ref[token_id])) for token_id, lp in entry.items())
        assert worst < 1e-4, f"{output.request_id} token {step}: logprobs off by {worst:.2e}"


@pytest.fixture(scope="module")
def picture() -> Image.Image:
    return random_image(112, 84, seed=5)  # 4 x 3 merged patches: 12 tokens


@pytest.fixture(scope="module")
def other_picture() -> Image.Image:
    return random_image(150, 100, seed=1)  # 5 x 4: 20 tokens


# -- a request holding a video is preempted -------------------------------------------------------


@pytest.fixture(scope="module")
def small_pool_engine(tiny_dir: Path) -> LLMEngine:
    # 10 blocks: the 36-token image prompt and the 120-token video prompt, each with 16 new
    # tokens, do not fit together; 32 tokens a step split the video's 96 placeholders.
    return make_engine(tiny_dir, num_blocks=10, budget=32, encoder_cache_tokens=None, prefix_caching=True)


def test_the_newest_request_is_preempted_mid_video_and_still_gives_transformers_tokens(  # type: ignore[no-untyped-def]
    small_pool_engine: LLMEngine,
    start_trace: Callable[[LLMEngine], Trace],
    picture: Image.Image,
    hf_model,
    hf_tokenizer,
    hf_image_processor,
) -> None:
    engine = small_pool_engine
    image_text, video_text = chat_prompt(f"{IMAGE}Describe this."), chat_prompt(f"{VIDEO}What happens in the video?")
    clip = write_video(16, fps=8, width=168, height=112)
    prompts = {
        "image": engine.processor.process(image_text, [ImageInput(picture)]),
        "video": engine.processor.process(video_text, [], [VideoInput(clip, VIDEO_OPTIONS)]),
    }
    (image,), (video,) = prompts["image"].mm_items, prompts["video"].mm_items
    assert (image.length, video.length) == (12, 96)
    trace = start_trace(engine)
    outputs = run(engine, prompts, max_tokens=16)

    # The video request, admitted last, is the one preempted (every time), once with its last
    # chunk ending inside the video.
    assert trace.preempted and {request_id for request_id, _ in trace.preempted} == {"video"}
    assert any(video.offset < computed < video.end for _, computed in trace.preempted), trace.preempted
    # Its video's encoder output stayed cached while it waited: encoded once.
    assert trace.encoded == [image.content_hash, video.content_hash]

    ids, vision = hf_prompt_ids(hf_tokenizer, hf_image_processor, image_text, [picture])
    assert ids == outputs["image"].prompt_token_ids
    assert_same_tokens_and_logprobs(outputs["image"], hf_greedy_with_logprobs(hf_model, ids, vision, 16))
    # transformers gets the same frames' patches (its video processor needs torchvision).
    media = [(video.pixel_values, video.grid_thw, video.second_per_grid_t)]
    ids, vision = hf_mm_prompt_ids(hf_tokenizer, hf_image_processor, video_text, media)
    del vision["second_per_grid_ts"]  # Qwen2-VL spaces video frames by one position, not by time
    assert ids == outputs["video"].prompt_token_ids
    assert_same_tokens_and_logprobs(outputs["video"], hf_greedy_with_logprobs(hf_model, ids, vision, 16))


# -- a request preempted inside an image re-encodes it after eviction ----------------------------


@pytest.fixture(scope="module")
def one_image_engine(tiny_dir: Path) -> LLMEngine:
    # 5 blocks; 16 tokens a step; an encoder cache that holds one of the two pictures at a time;
    # no prefix caching, so a preempted request recomputes from its first token.
    return make_engine(tiny_dir, num_blocks=5, budget=16, encoder_cache_tokens=20, prefix_caching=False)


def test_a_request_preempted_mid_image_re_encodes_its_evicted_images_and_still_gives_transformers_tokens(  # type: ignore[no-untyped-def]
    one_image_engine: LLMEngine,
    start_trace: Callable[[LLMEngine], Trace],
    picture: Image.Image,
    other_picture: Image.Image,
    hf_model,
    hf_tokenizer,
    hf_image_processor,
) -> None:
    engine = one_image_engine
    text_prompt, images_text = chat_prompt("Tell me about lighthouses."), chat_prompt(f"{IMAGE} then {IMAGE} which?")
    prompts = {
        "text": engine.processor.process(text_prompt, []),
        "images": engine.processor.process(images_text, [ImageInput(picture), ImageInput(other_picture)]),
    }
    first, second = prompts["images"].mm_items
    assert (first.length, second.length) == (12, 20)
    trace = start_trace(engine)
    outputs = run(engine, prompts, max_tokens=7)

    # The image request, the newest, was preempted once, right after a chunk that ended inside the
    # second picture (split across two chunks).
    ((request_id, computed),) = trace.preempted
    assert request_id == "images" and second.offset < computed < second.end
    # Encoded as the chunks reached them, then again on resume: the first picture's encode
    # evicted the second (one fits at a time), which was encoded once more.
    assert trace.encoded == [first.content_hash, second.content_hash] * 2

    ids, vision = hf_prompt_ids(hf_tokenizer, hf_image_processor, text_prompt, [])
    assert_same_tokens_and_logprobs(outputs["text"], hf_greedy_with_logprobs(hf_model, ids, vision, 7))
    ids, vision = hf_prompt_ids(hf_tokenizer, hf_image_processor, images_text, [picture, other_picture])
    assert ids == outputs["images"].prompt_token_ids
    reference = hf_greedy_with_logprobs(hf_model, ids, vision, 7)
    assert_same_tokens_and_logprobs(outputs["images"], reference)
    # The same prompt alone fits without preemption and gives the same.
    alone = run(engine, {"images alone": prompts["images"]}, max_tokens=7)["images alone"]
    assert len(trace.preempted) == 1
    assert_same_tokens_and_logprobs(alone, reference)
