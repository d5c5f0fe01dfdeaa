"""Seed 004: list-of-dicts inputs to token ids carrying shared-memory handles, and back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.serve.conftest import picture, segments_left
from vlmserve import LLM, SamplingParams
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.serve import shm, token_handles

PARAMS = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    return LLM(tiny_dir, dtype="float32", max_model_len=4096, kv_cache_memory_gib=0.05)


@pytest.fixture(scope="module")
def image_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("img") / "photo.png"
    picture(6, size=(150, 100)).save(path)
    return path


def test_tokenize_carries_handles_and_generation_matches_chat(llm: LLM, image_file: Path) -> None:
    inputs = [{"text": "Look:"}, {"image": str(image_file)}, {"text": "What is it?"}]
    ids = llm.tokenize(inputs)
    config = llm.llm_engine.model_config
    start = ids.index(config.vision_start_token_id) + 1
    name = shm.handle_to_name(ids[start])
    assert shm.int64_to_grid(ids[start + 1]) == (1, 8, 10)  # 150x100 -> 140x112
    assert set(ids[start + 2 : start + 20]) == {config.image_token_id}
    assert name in segments_left()
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image", "image": str(image_file)},
                {"type": "text", "text": "What is it?"},
            ],
        }
    ]
    expected = llm.chat(chat, PARAMS)[0]
    out = llm.generate({"prompt_token_ids": ids}, PARAMS)[0]
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert out.prompt_token_ids == expected.prompt_token_ids  # placeholders restored
    assert segments_left() == []


def test_the_engine_process_decodes_handles(tiny_dir: Path, llm: LLM, image_file: Path) -> None:
    from vlmserve.engine.config import EngineConfig
    from vlmserve.engine.frontend import load_frontend
    from vlmserve.serve.engine_client import EngineClient

    ids = llm.tokenize([{"image": str(image_file)}, {"text": "Describe."}])
    expected = (
        llm.generate({"prompt_token_ids": llm.tokenize([{"image": str(image_file)}, {"text": "Describe."}])}, PARAMS)[0]
        .outputs[0]
        .token_ids
    )

    async def run() -> list[int]:
        config = EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=4096, kv_cache_memory_bytes=32 << 20)
        client = EngineClient(config, load_frontend(config))
        assert client._dir.stat().st_mode & 0o777 == 0o700  # the engine sockets: this user only
        await client.start()
        try:
            final = None
            async for output in client.generate("h", ProcessedPrompt(ids, [], None, 0), PARAMS):
                final = output
            assert final is not None
            return final.outputs[0].token_ids
        finally:
            await client.shutdown()

    assert asyncio.run(run()) == expected
    assert segments_left() == []


def test_bad_inputs_are_refused_and_release_segments(llm: LLM, image_file: Path) -> None:
    with pytest.raises(ValueError, match=r"inputs\[1\]: this model has no audio input"):
        llm.tokenize([{"text": "x"}, {"audio": "a.mp3"}])
    with pytest.raises(ValueError, match="exactly one key"):
        llm.tokenize([{"text": "x", "image": "y"}])
    with pytest.raises(ValueError, match=r"inputs\[0\].image: file not found"):
        llm.tokenize([{"image": "/no/such.png"}])
    ids = llm.tokenize([{"image": str(image_file)}])
    start = ids.index(llm.llm_engine.model_config.vision_start_token_id) + 1
    tampered = list(ids)
    tampered[start + 1] = shm.grid_to_int64((1, 4, 4))  # a grid that does not match the run
    with pytest.raises(ValueError, match="does not match the placeholder run"):
        llm.generate({"prompt_token_ids": tampered})
    assert segments_left() == []
    ids = llm.tokenize([{"image": str(image_file)}])
    token_handles.release(ids, llm.llm_engine.model_config)  # never submitted
    assert segments_left() == []
