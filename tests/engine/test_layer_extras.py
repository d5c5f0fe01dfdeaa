"""Per-layer extras of encoder outputs (Qwen3-VL's DeepStack features) through the engine: a
prefix-cache hit that ends inside an image, an encoder-cache hit, and a request preempted after a
chunk that ended inside an image, each against transformers' greedy decoding of the prompt alone
(tokens and the logprobs of every step). The engine caches each image's whole stack of rows by
content hash and slices the rows of a chunk from it, extras included."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from tests.conftest import random_image
from tests.engine.test_preemption_multimodal import (
    Trace,
    assert_same_tokens_and_logprobs,
    hf_greedy_with_logprobs,
    run,
    start_trace,
)
from tests.reference import hf_mm_prompt_ids
from vlmserve.engine.config import EngineConfig
from vlmserve.entrypoints.llm_engine import LLMEngine
from vlmserve.processor.base import ImageInput

__all__ = ["start_trace"]  # the fixture, used by name

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
KV_BYTES_PER_TOKEN = 768  # the tiny Qwen3-VL in float32: 3 layers x (K + V) x 2 heads x 16 x 4 bytes
BLOCK_SIZE = 16


def chat(*parts: str) -> str:
    return f"<|im_start|>user\n{''.join(parts)}<|im_end|>\n<|im_start|>assistant\n"


def make_engine(model_dir: Path, num_blocks: int, budget: int, prefix_caching: bool) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=512,
            max_num_batched_tokens=budget,
            block_size=BLOCK_SIZE,
            kv_cache_memory_bytes=num_blocks * BLOCK_SIZE * KV_BYTES_PER_TOKEN,
            enable_prefix_caching=prefix_caching,
            limit_mm_per_prompt={"image": 2, "video": 1},
        )
    )
    assert engine.kv.pool.num_blocks == num_blocks
    return engine


def reference(model_dir: Path, hf_model, text: str, pictures: list[Image.Image], max_new: int):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))
    ids, vision = hf_mm_prompt_ids(tokenizer, processor, text, pictures)
    return ids, hf_greedy_with_logprobs(hf_model, ids, vision, max_new)


@pytest.fixture(scope="module")
def picture() -> Image.Image:
    return random_image(16 * 20, 16 * 14, seed=21)  # 10 x 7 merged patches: 70 tokens


def test_prefix_and_encoder_cache_hits_inside_an_image_give_transformers_tokens(  # type: ignore[no-untyped-def]
    tiny3_dir: Path, hf3_model, picture: Image.Image, start_trace: Callable[[LLMEngine], Trace]
) -> None:
    engine = make_engine(tiny3_dir, num_blocks=40, budget=512, prefix_caching=True)
    first_text, second_text = chat(IMAGE, "Describe it."), chat(IMAGE, "What colour dominates here?")
    first = engine.processor.process(first_text, [ImageInput(picture)])
    second = engine.processor.process(second_text, [ImageInput(picture)])
    (item,) = second.mm_items
    assert (item.offset, item.length) == (4, 70)
    trace = start_trace(engine)
    run(engine, {"first": first}, max_tokens=6)
    hits = engine.kv.prefix_hits
    outputs = run(engine, {"second": second}, max_tokens=6)
    # The prompts share their first 75 tokens: 4 whole blocks (64 tokens) are reused, so the
    # second prompt's first chunk starts at placeholder 60 of the image, whose rows (extras
    # included) come from the encoder cache: the image was encoded once.
    assert engine.kv.prefix_hits - hits == 64 and item.offset < 64 < item.end
    assert trace.encoded == [item.content_hash]
    ids, expected = reference(tiny3_dir, hf3_model, second_text, [picture], 6)
    assert ids == outputs["second"].prompt_token_ids
    assert_same_tokens_and_logprobs(outputs["second"], expected)


def test_a_request_preempted_inside_an_image_resumes_with_transformers_tokens(  # type: ignore[no-untyped-def]
    tiny3_dir: Path, hf3_model, picture: Image.Image, start_trace: Callable[[LLMEngine], Trace]
) -> None:
    # 8 blocks (128 tokens): the two ~80-token prompts with 12 new tokens each do not fit
    # together; 24 tokens a step cut the images into chunks.
    engine = make_engine(tiny3_dir, num_blocks=8, budget=24, prefix_caching=False)
    other = random_image(16 * 16, 16 * 16, seed=22)  # 8 x 8: 64 tokens
    texts = {"old": chat(IMAGE, "What is this?"), "new": chat(IMAGE, "Describe the scene.")}
    pictures = {"old": other, "new": picture}
    prompts = {k: engine.processor.process(texts[k], [ImageInput(pictures[k])]) for k in texts}
    trace = start_trace(engine)
    outputs = run(engine, prompts, max_tokens=12)
    (item,) = prompts["new"].mm_items
    assert trace.preempted and {request_id for request_id, _ in trace.preempted} == {"new"}
    assert any(item.offset < computed < item.end for _, computed in trace.preempted), trace.preempted
    for key in texts:
        ids, expected = reference(tiny3_dir, hf3_model, texts[key], [pictures[key]], 12)
        assert ids == outputs[key].prompt_token_ids
        assert_same_tokens_and_logprobs(outputs[key], expected)


def test_the_encoder_cache_is_sized_for_the_extras(tiny3_dir: Path) -> None:
    """Each cached placeholder token holds the input row and two DeepStack rows."""
    engine = make_engine(tiny3_dir, num_blocks=8, budget=64, prefix_caching=False)
    tokens = engine.scheduler.encoder_cache.capacity
    assert engine.core.memory_plan.encoder_cache_bytes == tokens * 64 * 3 * 4
