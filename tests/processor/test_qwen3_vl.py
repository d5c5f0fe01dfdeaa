"""The Qwen3-VL processor against transformers 5.23: which frames of a video, their size, the
timestamps, and the prompt with one timestamped span per temporal patch (transformers'
Qwen3VLProcessor.replace_video_token), images at 16-pixel patches as its image processor makes them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import random_image, write_video
from vlmserve.families.qwen3_vl.processor import Qwen3VLProcessor
from vlmserve.families.qwen3_vl.video import clip_size, patch_timestamps, sample_indices
from vlmserve.model_files import read_json
from vlmserve.multimodal.image import ImageProcessorConfig
from vlmserve.multimodal.media import MediaError
from vlmserve.multimodal.video import VideoOptions
from vlmserve.processor.base import ImageInput, ProcessorLimits, VideoInput
from vlmserve.registry import load_model_config
from vlmserve.tokenizer import Tokenizer

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def make_processor(model_dir: Path, max_model_len: int = 4096) -> Qwen3VLProcessor:
    return Qwen3VLProcessor(
        load_model_config(model_dir / "config.json"),
        Tokenizer(model_dir),
        ImageProcessorConfig.from_dict(read_json(model_dir / "preprocessor_config.json")),
        ProcessorLimits(max_model_len),
        video_config=ImageProcessorConfig.from_dict(read_json(model_dir / "video_preprocessor_config.json")),
    )


@pytest.mark.parametrize(
    ("total", "video_fps", "options"),
    [
        (40, 24.0, VideoOptions()),  # 2 fps of 1.7 s: 3 frames, raised to min_frames 4
        (300, 30.0, VideoOptions()),  # 10 s: 20 frames
        (300, 30.0, VideoOptions(fps=0.5)),
        (300, 30.0, VideoOptions(nframes=7)),
        (1000, 25.0, VideoOptions(fps=4, max_frames=50)),
        (3, 10.0, VideoOptions()),  # fewer frames than min_frames: all of them
    ],
)
def test_frames_are_those_transformers_samples(total: int, video_fps: float, options: VideoOptions) -> None:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    kwargs = {"max_frames": options.max_frames} if options.max_frames else {}
    reference = Qwen3VLVideoProcessor(**kwargs).sample_frames(
        VideoMetadata(total_num_frames=total, fps=video_fps),
        num_frames=options.nframes,
        fps=None if options.nframes is not None else options.fps,
    )
    assert sample_indices(options, total, video_fps) == reference.tolist()


@pytest.mark.parametrize(
    "shape", [(8, 48, 64), (4, 1080, 1920), (21, 720, 1280), (2, 20, 300), (768, 360, 640), (5, 33, 31)]
)
def test_clip_size_is_transformers_smart_resize(shape: tuple[int, int, int]) -> None:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    assert clip_size(*shape, 32, 2, 4096, 25165824) == smart_resize(*shape, 2, 32, 4096, 25165824)


def test_timestamps_are_transformers() -> None:
    from transformers import Qwen3VLProcessor as Reference

    indices = [0, 13, 26, 39, 52, 52]
    assert patch_timestamps(tuple(indices), 24.0, 2) == Reference._calculate_timestamps(None, indices, 24.0, 2)


def test_a_video_prompt_is_written_as_transformers_writes_it(tiny3_dir: Path) -> None:
    """One span per temporal patch after its timestamp, inside the template's own vision markers;
    each span one item of grid (1, h, w) and its own rows of the clip's pixels."""
    from transformers import AutoTokenizer
    from transformers import Qwen3VLProcessor as Reference
    from transformers.video_utils import VideoMetadata

    processor = make_processor(tiny3_dir)
    clip = write_video(20, fps=8, width=64, height=48)  # 2.5 s: 5 frames at 2 fps, padded to 6
    text = f"<|im_start|>user\n{VIDEO}What happens?<|im_end|>\n<|im_start|>assistant\n"
    prompt = processor.process(text, [], [VideoInput(clip)])
    indices = sample_indices(VideoOptions(), 20, 8.0)
    assert indices == [0, 5, 10, 14, 19]
    t, h, w = 3, 64 // 16, 64 // 16  # 5 frames x 48 x 64 rounds to 64 x 64 (no bound reached)
    assert [item.grid_thw for item in prompt.mm_items] == [(1, h, w)] * t
    assert len({item.content_hash for item in prompt.mm_items}) == t

    stub = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
        video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>",
        vision_end_token="<|vision_end|>",
        _calculate_timestamps=lambda *a: Reference._calculate_timestamps(None, *a),
    )
    video_inputs = {
        "video_grid_thw": torch.tensor([[t, h, w]]),
        "video_metadata": [VideoMetadata(total_num_frames=20, fps=8.0, frames_indices=indices)],
    }
    expanded = Reference.replace_video_token(stub, video_inputs, 0)
    assert expanded.startswith("<0.3 seconds><|vision_start|><|video_pad|>")  # frames 0 and 5 at 8 fps
    tokenizer = AutoTokenizer.from_pretrained(str(tiny3_dir))
    ids = tokenizer(text.replace("<|video_pad|>", expanded), add_special_tokens=False)["input_ids"]
    assert ids == prompt.prompt_token_ids
    for item in prompt.mm_items:
        assert set(ids[item.offset : item.end]) == {151656}
        assert ids[item.offset - 1] == 151652 and ids[item.end] == 151653
    # The padding frame repeats the last: the third temporal patch's two frames are equal.
    last = prompt.mm_items[2].pixel_values.reshape(-1, 3, 2, 16 * 16)
    assert torch.equal(last[:, :, 0], last[:, :, 1])


def test_images_are_transformers_patches_at_16_pixels(tiny3_dir: Path) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    reference = Qwen2VLImageProcessorPil.from_pretrained(str(tiny3_dir))
    pictures = [random_image(150, 100, seed=1), random_image(700, 90, seed=2), random_image(33, 45, seed=3)]
    prompt = make_processor(tiny3_dir).process(f"{IMAGE}{IMAGE}{IMAGE}", [ImageInput(p) for p in pictures])
    out = reference(pictures, return_tensors="pt")
    assert [list(item.grid_thw) for item in prompt.mm_items] == out["image_grid_thw"].tolist()
    assert np.array_equal(torch.cat([i.pixel_values for i in prompt.mm_items]).numpy(), out["pixel_values"].numpy())
    # min_pixels 65536: the 150 x 100 picture grows to 320 x 224 (a 14 x 20 patch grid).
    assert prompt.mm_items[0].grid_thw == (1, 14, 20)


def test_unsupported_video_options_are_named(tiny3_dir: Path) -> None:
    clip = write_video(8, fps=8, width=64, height=48)
    with pytest.raises(MediaError, match="video_start are not options of Qwen3-VL's video processor"):
        make_processor(tiny3_dir).process(VIDEO, [], [VideoInput(clip, VideoOptions(video_start=0.5))])
