"""Qwen3-VL and Qwen3-VL-MoE against transformers 5.23 on the same tiny checkpoint files: configs,
the vision tower and its DeepStack features, interleaved M-RoPE, a missing expert named, videos
(logits chunked inside a timestamped span, greedy tokens through the offline API), make-tiny.
Float32 logits for images of several sizes and prefill chunks that end inside them (DeepStack
features split across steps), and greedy tokens batched, alone and cached, are the families'
conformance suite's (tests/families), for the dense model and the MoE one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import random_image, write_video
from tests.model_harness import Harness
from tests.published_configs import QWEN3_VL_2B, QWEN3_VL_8B, QWEN3_VL_30B_A3B
from tests.reference import hf_mm_greedy, hf_mm_logits, hf_mm_prompt_ids, mm_token_type_ids
from vlmserve.families.common.decoder import MRotaryEmbedding
from vlmserve.families.qwen2_vl.processor import Qwen2VLProcessor
from vlmserve.families.qwen3_vl.config import Qwen3VLFamilyConfig
from vlmserve.families.qwen3_vl.tiny import PRESETS, config_json
from vlmserve.model_files import read_json
from vlmserve.multimodal.image import ImageProcessorConfig
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.processor.base import ImageInput, ProcessorLimits, VideoInput
from vlmserve.registry import load_model_config, parse_model_config
from vlmserve.tokenizer import Tokenizer

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def chat(*parts: str) -> str:
    return f"<|im_start|>user\n{''.join(parts)}<|im_end|>\n<|im_start|>assistant\n"


def image(grid_h: int, grid_w: int, seed: int) -> Image.Image:
    """An image the processor keeps at its size: grid_h x grid_w patches of 16 px (both even, and
    at least 65536 pixels, the published min_pixels)."""
    return random_image(16 * grid_w, 16 * grid_h, seed=seed)


def process(model_dir: Path, text: str, pictures: list[Image.Image]) -> ProcessedPrompt:
    config = load_model_config(model_dir / "config.json")
    image_config = ImageProcessorConfig.from_dict(read_json(model_dir / "preprocessor_config.json"))
    processor = Qwen2VLProcessor(config, Tokenizer(model_dir), image_config, ProcessorLimits(4096))
    return processor.process(text, [ImageInput(p) for p in pictures])


def hf_inputs(model_dir: Path, text: str, pictures: list[Image.Image]) -> tuple[list[int], dict]:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return hf_mm_prompt_ids(tokenizer, Qwen2VLImageProcessorPil.from_pretrained(str(model_dir)), text, pictures)


@pytest.fixture(scope="module")
def harness(tiny3_dir: Path) -> Harness:
    return Harness(tiny3_dir, torch.float32)


@pytest.fixture(scope="module")
def moe_harness(tiny3_moe_dir: Path) -> Harness:
    return Harness(tiny3_moe_dir, torch.float32)


# -- config ---------------------------------------------------------------------------------------


def test_published_configs_parse() -> None:
    small, dense, moe = (parse_model_config(raw) for raw in (QWEN3_VL_2B, QWEN3_VL_8B, QWEN3_VL_30B_A3B))
    assert (small.architecture, dense.architecture, moe.architecture) == (
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
    )
    # 4.57's rope_scaling + rope_theta and 5's rope_parameters read alike.
    for config in (small, dense, moe):
        assert config.text.mrope_section == (24, 20, 20) and config.text.rope_theta == 5e6
        assert config.family_config.mrope_interleaved and config.vision.patch_size == 16
        assert config.vision.patch_dim == 3 * 2 * 16 * 16
    assert small.family_config.deepstack_visual_indexes == (5, 11, 17)
    assert (small.vision.embed_dim, small.vision.hidden_size, small.text.tie_word_embeddings) == (1024, 2048, True)
    assert (dense.vision.depth, dense.vision.embed_dim, dense.vision.hidden_size) == (27, 1152, 4096)
    assert moe.family_config.moe is not None
    assert (moe.family_config.moe.num_experts, moe.family_config.moe.num_experts_per_tok) == (128, 8)
    assert moe.text.num_key_value_heads == 4 and not moe.text.tie_word_embeddings


@pytest.mark.parity
def test_tiny_config_reads_as_transformers_reads_it(tiny3_dir: Path, tiny3_moe_dir: Path) -> None:
    from transformers import AutoConfig

    for model_dir in (tiny3_dir, tiny3_moe_dir):
        ours, theirs = load_model_config(model_dir / "config.json"), AutoConfig.from_pretrained(str(model_dir))
        text, vision = theirs.text_config, theirs.vision_config
        family = ours.family_config
        assert isinstance(family, Qwen3VLFamilyConfig)
        assert ours.text.mrope_section == tuple(text.rope_parameters["mrope_section"])
        assert (ours.text.head_dim, ours.text.num_key_value_heads) == (text.head_dim, text.num_key_value_heads)
        assert family.deepstack_visual_indexes == tuple(vision.deepstack_visual_indexes)
        assert (ours.vision.embed_dim, ours.vision.hidden_size) == (vision.hidden_size, vision.out_hidden_size)
        if family.moe is not None:
            assert (family.moe.num_experts, family.moe.num_experts_per_tok) == (
                text.num_experts,
                text.num_experts_per_tok,
            )
            assert family.moe.mlp_only_layers == tuple(text.mlp_only_layers) == (1,)


def test_2b_preset_is_the_published_qwen3_vl_2b_architecture() -> None:
    preset = parse_model_config(config_json(PRESETS[("qwen3_vl", "2b")]))
    assert preset == parse_model_config(QWEN3_VL_2B)
    assert preset != parse_model_config(config_json(PRESETS[("qwen3_vl", "bench")]))  # the comparison can fail


def test_bad_configs_say_what_is_wrong() -> None:
    vision = QWEN3_VL_2B["vision_config"]
    with pytest.raises(ValueError, match=r"deepstack_visual_indexes \[5, 30\] must name distinct blocks in 0..23"):
        parse_model_config({**QWEN3_VL_2B, "vision_config": {**vision, "deepstack_visual_indexes": [5, 30]}})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="num_position_embeddings 2300 must be a square"):
        parse_model_config({**QWEN3_VL_2B, "vision_config": {**vision, "num_position_embeddings": 2300}})  # type: ignore[dict-item]
    text = {k: v for k, v in QWEN3_VL_30B_A3B["text_config"].items() if k != "num_experts"}  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="lacks required field 'num_experts'"):
        parse_model_config({**QWEN3_VL_30B_A3B, "text_config": text})


# -- rotary and the vision tower ----------------------------------------------------------------


@pytest.mark.parity
def test_interleaved_mrope_matches_transformers() -> None:
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    reference = Qwen3VLTextRotaryEmbedding(Qwen3VLTextConfig(head_dim=128, rope_parameters=rope))
    positions = torch.stack([torch.arange(50) * 3, torch.arange(50) % 7 + 100, torch.arange(50) // 5 + 200])
    cos, sin = reference(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    ours_cos, ours_sin = MRotaryEmbedding(128, 5e6, (24, 20, 20), interleaved=True)(positions, torch.float32)
    assert torch.equal(ours_cos, cos[0]) and torch.equal(ours_sin, sin[0])
    sectioned, _ = MRotaryEmbedding(128, 5e6, (24, 20, 20), interleaved=False)(positions, torch.float32)
    assert not torch.allclose(sectioned, cos[0], atol=1e-3)  # the layouts differ where t, h, w differ


@pytest.mark.parity
@pytest.mark.parametrize(
    "grids",
    [
        [(1, 16, 16)],  # 16 x 16 patches on the 8 x 8 learned grid
        [(1, 4, 6), (1, 22, 14)],  # smaller and larger than the grid, side by side
        [(2, 6, 8), (1, 8, 8)],  # a video's two frames, then an image exactly the grid's size
    ],
)
def test_vision_tower_and_deepstack_match_transformers(grids, tiny3_dir: Path, harness: Harness, hf3_model) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 16 * 16, generator=g)
    with torch.no_grad():
        ours = harness.model.visual(pixels, grids)
        out = hf3_model.model.visual(pixels, grid_thw=torch.tensor(grids))
    assert ours.shape == (3, pixels.shape[0] // 4, 64)  # the merged tokens and two DeepStack features
    assert (ours[0] - out.pooler_output).abs().max().item() < 1e-5
    for k, feature in enumerate(out.deepstack_features):
        assert (ours[1 + k] - feature).abs().max().item() < 1e-5


def test_a_video_encodes_frame_by_frame(harness: Harness) -> None:
    """The property the processor relies on to make a video one item per temporal patch."""
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(3 * 6 * 8, 3 * 2 * 16 * 16, generator=g)
    with torch.no_grad():
        whole = harness.model.visual(pixels, [(3, 6, 8)])
        frames = harness.model.visual(pixels, [(1, 6, 8)] * 3)
    assert torch.equal(whole, frames)


def test_missing_expert_weight_is_named(tiny3_moe_dir: Path, tmp_path: Path) -> None:
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny3_moe_dir, broken)
    name = "model.language_model.layers.2.mlp.experts.down_proj"
    for shard in broken.glob("*.safetensors"):
        weights = load_file(str(shard))
        if name in weights:
            del weights[name]
            save_file(weights, str(shard))
    index = broken / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"][name]
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"lacks weights: \['model.layers.2.mlp.experts.down_proj'\]"):
        Harness(broken)


# -- greedy decoding (what test_qwen3_vl_moe_checkpoints.py runs) -------------------------------

MAX_NEW = 8
GREEDY_CASES = [
    (chat(IMAGE, "What is in this image?"), [(14, 20, 8)]),
    (chat(IMAGE, IMAGE, "Which is darker?"), [(16, 16, 9), (22, 14, 10)]),
    (chat("Write a haiku about the sea."), []),
]


# -- video ----------------------------------------------------------------------------------------


def video_prompt(model_dir: Path, text: str, pictures: list[Image.Image], clip: bytes) -> tuple[ProcessedPrompt, dict]:
    """Our processed prompt, and transformers' vision inputs for it: the same pixels, the video as
    one (t, h, w) grid as its video processor would give it (the processor itself needs torchvision)."""
    from tests.processor.test_qwen3_vl import make_processor

    prompt = make_processor(model_dir).process(text, [ImageInput(p) for p in pictures], [VideoInput(clip)])
    images = [item for item in prompt.mm_items if item.modality == "image"]
    frames = [item for item in prompt.mm_items if item.modality == "video"]
    _, h, w = frames[0].grid_thw
    vision = {
        "pixel_values_videos": torch.cat([item.pixel_values for item in frames]),
        "video_grid_thw": torch.tensor([[len(frames), h, w]]),
    }
    if images:
        vision |= {
            "pixel_values": torch.cat([item.pixel_values for item in images]),
            "image_grid_thw": torch.tensor([item.grid_thw for item in images]),
        }
    return prompt, vision


@pytest.mark.parity
def test_video_logits_chunked_match_transformers_float32(tiny3_dir: Path, harness: Harness, hf3_model) -> None:  # type: ignore[no-untyped-def]
    """An image then a 3-patch video: transformers' positions (each timestamped span at the
    temporal position of its start) and logits, our prefill cut inside a span."""
    clip = write_video(20, fps=8, width=64, height=48)
    text = chat(IMAGE, "and", VIDEO, "what happens?")
    prompt, vision = video_prompt(tiny3_dir, text, [image(14, 16, 12)], clip)
    ids = prompt.prompt_token_ids
    positions, delta = hf3_model.model.get_rope_index(
        torch.tensor([ids]), mm_token_type_ids(torch.tensor([ids])), vision["image_grid_thw"], vision["video_grid_thw"]
    )
    assert torch.equal(positions[:, 0], prompt.mrope_positions) and int(delta) == prompt.mrope_delta
    span = prompt.mm_items[2]
    chunks = [span.offset + 7, prompt.num_tokens - span.offset - 7]
    reference = hf_mm_logits(hf3_model, ids, vision)
    assert (harness.logits(prompt, chunks=chunks) - reference).abs().max().item() < 1e-4


@pytest.mark.parity
def test_video_greedy_through_the_offline_api_matches_transformers_generate(tiny3_dir: Path, hf3_model) -> None:  # type: ignore[no-untyped-def]
    """A video file through LLM.generate (the processor's timestamped spans, the engine's
    per-span items) against transformers' generate on the same pixels."""
    from vlmserve import LLM, SamplingParams

    clip = write_video(20, fps=8, width=64, height=48)
    text = chat(VIDEO, "What happens?")
    llm = LLM(tiny3_dir, dtype="float32", max_model_len=1024, kv_cache_memory_gib=0.02, max_num_batched_tokens=40)
    (out,) = llm.generate(
        {"prompt": text, "multi_modal_data": {"video": clip}}, SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    )
    prompt, vision = video_prompt(tiny3_dir, text, [], clip)
    assert out.prompt_token_ids == prompt.prompt_token_ids
    assert out.outputs[0].token_ids == hf_mm_greedy(hf3_model, prompt.prompt_token_ids, vision, MAX_NEW)


@pytest.mark.parametrize(
    ("arch", "architecture"),
    [("qwen3_vl", "Qwen3VLForConditionalGeneration"), ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration")],
)
def test_make_tiny_writes_the_published_layout(arch: str, architecture: str, tmp_path: Path) -> None:
    import json

    from vlmserve.entrypoints.cli import main

    out = tmp_path / arch
    assert main(["make-tiny", "--arch", arch, "--untied", "--shards", "2", str(out)]) == 0
    config = load_model_config(out / "config.json")
    assert config.architecture == architecture and not config.text.tie_word_embeddings
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" in names and "model.visual.deepstack_merger_list.1.linear_fc2.weight" in names
    assert ("model.language_model.layers.0.mlp.experts.gate_up_proj" in names) == (arch == "qwen3_vl_moe")
    assert read_json(out / "preprocessor_config.json")["image_mean"] == [0.5, 0.5, 0.5]
