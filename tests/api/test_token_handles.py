"""List-of-dicts inputs to token ids carrying shared-memory handles, and back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tests.api.conftest import picture, segments_left
from tests.conftest import write_video
from vlmserve import LLM, SamplingParams
from vlmserve.api import list_format
from vlmserve.ipc import shm, token_handles
from vlmserve.multimodal import handles
from vlmserve.multimodal.inputs import ProcessedPrompt

PARAMS = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(tiny_llm: LLM) -> LLM:
    return tiny_llm  # the session's (tests/conftest.py)


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
    assert handles.int64_to_grid(ids[start + 1]) == ("image", (1, 8, 10))  # 150x100 -> 140x112
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


def test_the_engine_process_decodes_handles_and_frees_segments_on_abort_and_refusal(
    tiny_dir: Path, llm: LLM, image_file: Path
) -> None:
    from vlmserve.api.engine_client import EngineClient, RequestRefused
    from vlmserve.api.engine_supervisor import EngineDeadError
    from vlmserve.api.frontend import load_frontend
    from vlmserve.engine.config import EngineConfig

    inputs = [{"image": str(image_file)}, {"text": "Describe."}]
    expected = llm.generate({"prompt_token_ids": llm.tokenize(inputs)}, PARAMS)[0].outputs[0].token_ids
    ids, aborted, tampered = llm.tokenize(inputs), llm.tokenize(inputs), llm.tokenize(inputs)
    start = tampered.index(llm.llm_engine.model_config.vision_start_token_id) + 1
    tampered[start + 1] = handles.grid_to_int64((1, 4, 4))  # a grid that does not match the run
    assert len(segments_left()) == 3

    async def run() -> list[int]:
        config = EngineConfig(model=str(tiny_dir), dtype="float32", max_model_len=4096, kv_cache_memory_bytes=32 << 20)
        client = EngineClient(config, load_frontend(config))
        assert client._dir.stat().st_mode & 0o777 == 0o700  # the engine sockets: this user only
        try:
            with pytest.raises(EngineDeadError, match="not running"):  # refused before it is sent: freed here
                async for _ in client.generate("early", ProcessedPrompt(llm.tokenize(inputs), [], None, 0), PARAMS):
                    pass
            assert len(segments_left()) == 3
            await client.start()
            with pytest.raises(RequestRefused, match="does not match the placeholder run"):
                async for _ in client.generate("bad", ProcessedPrompt(tampered, [], None, 0), PARAMS):
                    pass
            stream = client.generate("gone", ProcessedPrompt(aborted, [], None, 0), PARAMS)
            await stream.__anext__()
            await stream.aclose()  # the client went away after one token
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
    with pytest.raises(ValueError, match=r"inputs\[1\]\.audio: this model has no audio input"):
        llm.tokenize([{"text": "x"}, {"audio": "a.mp3"}])
    with pytest.raises(ValueError, match="exactly one key"):
        llm.tokenize([{"text": "x", "image": "y"}])
    with pytest.raises(ValueError, match=r"inputs\[0\].image: file not found"):
        llm.tokenize([{"image": "/no/such.png"}])
    ids = llm.tokenize([{"image": str(image_file)}])
    start = ids.index(llm.llm_engine.model_config.vision_start_token_id) + 1
    tampered = list(ids)
    tampered[start + 1] = handles.grid_to_int64((1, 4, 4))  # a grid that does not match the run
    with pytest.raises(ValueError, match="does not match the placeholder run"):
        llm.generate({"prompt_token_ids": tampered})
    assert segments_left() == []
    tampered[start] = llm.tokenize([{"image": str(image_file)}])[start]  # the engine's decode alone frees it too
    with pytest.raises(ValueError, match="does not match the placeholder run"):
        token_handles.decode(tampered, llm.llm_engine.processor)
    assert segments_left() == []
    ids = llm.tokenize([{"image": str(image_file)}])
    token_handles.release(ids, llm.llm_engine.processor)  # never submitted
    assert segments_left() == []
    # A prompt the batch never reaches (an earlier one is refused) and one refused for its length.
    ids = llm.tokenize([{"image": str(image_file)}])
    with pytest.raises(ValueError, match=r"prompts\[0\] has unknown keys"):
        llm.generate([{"prompt": "x", "stray": 1}, {"prompt_token_ids": ids}])
    assert segments_left() == []
    ids = llm.tokenize([{"image": str(image_file)}])
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt of 4\d\d\d tokens leaves no room within max_model_len"):
        llm.generate({"prompt_token_ids": ids + [100] * 4096})
    assert segments_left() == []


@pytest.mark.parametrize("checkpoint", ["tiny_dir", "tiny25_dir", "tiny3_dir"])
def test_videos_and_images_round_trip_through_handles_for_each_qwen2_family(
    checkpoint: str, request: pytest.FixtureRequest, tmp_path: Path, image_file: Path
) -> None:
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL (whose processing info Qwen3.5 uses as it is): a video
    (a Qwen3-VL video: one item per timestamped span) and an image after it, each with a handle,
    its grid tagged with its modality, and a video's seconds per temporal patch; decoded, the
    prompt is the one the chat gives, item for item."""
    from vlmserve.api.frontend import load_frontend
    from vlmserve.engine.config import EngineConfig
    from vlmserve.processor.base import ImageInput, VideoInput

    model_dir = request.getfixturevalue(checkpoint)
    frontend = load_frontend(EngineConfig(model=str(model_dir), max_model_len=4096))
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(write_video(10, fps=8, width=168, height=112))  # 4 frames at 3.2 fps: 0.625 s per patch
    inputs = [{"text": "Watch:"}, {"video": str(clip)}, {"image": str(image_file)}, {"text": "And this?"}]
    ids = list_format.tokenize(frontend, inputs)

    messages = [{"role": "user", "content": [{"type": k, k: v} for entry in inputs for k, v in entry.items()]}]
    chat = frontend.render_chat(messages)
    images = [ImageInput(i.source, i.sizing) for i in chat.images]
    expected = frontend.processor.process(chat.prompt, images, [VideoInput(v.source, v.options) for v in chat.videos])
    assert [item.modality for item in expected.mm_items][-1] == "image" and len(expected.mm_items) >= 2
    config = frontend.model_config
    changed = [p for p, (a, b) in enumerate(zip(ids, expected.prompt_token_ids, strict=True)) if a != b]
    layout = []
    for item in expected.mm_items:
        p = item.offset
        assert ids[p - 1] == config.vision_start_token_id
        assert shm.handle_to_name(ids[p]) in segments_left()
        assert handles.int64_to_grid(ids[p + 1]) == (item.modality, item.grid_thw)
        layout += [p, p + 1]
        if item.modality == "video":
            assert handles.int64_to_seconds(ids[p + 2]) == pytest.approx(0.625)
            layout.append(p + 2)
    assert changed == layout  # nothing else differs from the chat's prompt

    decoded, items = token_handles.decode(ids, frontend.processor)
    assert segments_left() == []
    assert decoded == expected.prompt_token_ids
    for got, want in zip(items, expected.mm_items, strict=True):
        assert (got.modality, got.offset, got.length, got.grid_thw) == (
            want.modality,
            want.offset,
            want.length,
            want.grid_thw,
        )
        assert torch.equal(got.pixel_values, want.pixel_values)
        assert got.second_per_grid_t == (None if want.second_per_grid_t is None else pytest.approx(0.625))
    rebuilt = frontend.processor.from_token_ids(decoded, items)
    assert expected.mrope_positions is not None and rebuilt.mrope_positions is not None
    assert torch.equal(rebuilt.mrope_positions, expected.mrope_positions)
    assert rebuilt.mrope_delta == expected.mrope_delta
