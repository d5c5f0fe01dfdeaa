"""The Qwen2.5-VL model against transformers on the same checkpoint files: window attention over
partial windows, images of several sizes, videos with absolute-time positions, greedy decoding."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import random_image
from tests.model_harness import Harness
from tests.processor.test_qwen2_vl import make_processor
from tests.published_configs import QWEN2_5_VL_7B
from tests.reference import hf_mm_greedy, hf_mm_logits, hf_mm_prompt_ids, mm_token_type_ids, video_patches
from vlmserve.families.qwen2_vl.vision_2_5 import window_partition
from vlmserve.model_files import read_json
from vlmserve.multimodal.image import ImageProcessorConfig, process_image
from vlmserve.multimodal.inputs import MultiModalItem, ProcessedPrompt
from vlmserve.multimodal.mrope import mrope_positions
from vlmserve.processor.base import ImageInput
from vlmserve.registry import load_model_config, parse_model_config
from vlmserve.tokenizer import Tokenizer

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def chat(*parts: str) -> str:
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    return f"{system}<|im_start|>user\n{''.join(parts)}<|im_end|>\n<|im_start|>assistant\n"


def image(grid_h: int, grid_w: int, seed: int) -> Image.Image:
    """An image the processor keeps at its size: grid_h x grid_w patches of 14 px (both even)."""
    return random_image(14 * grid_w, 14 * grid_h, seed=seed)


@dataclass(frozen=True)
class Video:
    """Random normalised frames [num_frames, 3, height, width] sampled second_per_grid_t / 2 s apart."""

    num_frames: int
    height: int
    width: int
    second_per_grid_t: float
    seed: int = 0

    def patches(self) -> tuple[torch.Tensor, tuple[int, int, int], float]:
        g = torch.Generator().manual_seed(self.seed)
        frames = torch.randn(self.num_frames, 3, self.height, self.width, generator=g)
        pixel_values, grid = video_patches(frames)
        return pixel_values, grid, self.second_per_grid_t


# 4 frames of 140 x 196: grid (2, 10, 14), merged 5 x 7 per frame (windows 4x4, 4x3, 1x4, 1x3);
# 2 positions per second, 1 s per temporal patch: temporal positions 0, 2, below max(5, 7).
SHORT_VIDEO = Video(4, 140, 196, second_per_grid_t=1.0, seed=1)
# 6 frames of 56 x 84: grid (3, 4, 6), merged 2 x 3; 2 s per temporal patch: temporal positions
# 0, 4, 8, past max(2, 3), where transformers 5.23 resumes text too early (see mrope.py).
LONG_VIDEO = Video(6, 56, 84, second_per_grid_t=2.0, seed=2)


@pytest.fixture(scope="module")
def harness(tiny25_dir: Path) -> Harness:
    return Harness(tiny25_dir, torch.float32)


@pytest.fixture(scope="module")
def hf_tok_and_images(tiny25_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return AutoTokenizer.from_pretrained(str(tiny25_dir)), Qwen2VLImageProcessorPil.from_pretrained(str(tiny25_dir))


def our_prompt(model_dir: Path, text: str, media: list[Image.Image | Video]) -> ProcessedPrompt:
    """A prompt with images and videos laid out as the processor lays out images: each
    placeholder expanded, one item per image or video, M-RoPE positions with the checkpoint's
    tokens_per_second. Built by hand so that the video patches are exactly those given to
    transformers (whose video processor needs torchvision)."""
    config = load_model_config(model_dir / "config.json")
    image_config = ImageProcessorConfig.from_dict(read_json(model_dir / "preprocessor_config.json"))
    pads = {config.image_token_id, config.video_token_id}
    expanded: list[int] = []
    items: list[MultiModalItem] = []
    pending = iter(media)
    for token in Tokenizer(model_dir).encode(text):
        if token not in pads:
            expanded.append(token)
            continue
        medium = next(pending)
        if isinstance(medium, Image.Image):
            assert token == config.image_token_id
            processed = process_image(medium, image_config)
            pixel_values, grid, seconds = torch.from_numpy(processed.pixel_values), processed.grid_thw, None
            size = processed.resized_size
        else:
            assert token == config.video_token_id
            pixel_values, grid, seconds = medium.patches()
            size = (medium.width, medium.height)
        length = grid[0] * grid[1] * grid[2] // config.vision.spatial_merge_size**2
        modality = "image" if seconds is None else "video"
        # The engine caches encodings and prefix KV by content hash.
        content_hash = hashlib.sha256(pixel_values.numpy().tobytes() + repr((grid, seconds)).encode()).hexdigest()
        items.append(
            MultiModalItem(modality, len(expanded), length, grid, content_hash, pixel_values, size, size, seconds)
        )
        expanded.extend([token] * length)
    positions, delta = mrope_positions(
        len(expanded), items, config.vision.spatial_merge_size, config.vision.tokens_per_second
    )
    return ProcessedPrompt(expanded, items, positions, delta, text)


def hf_media(media: list[Image.Image | Video]) -> list:
    return [m if isinstance(m, Image.Image) else m.patches() for m in media]


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parity
def test_flat_and_nested_configs_parse_alike(tiny25_dir: Path, tmp_path: Path) -> None:
    from transformers import Qwen2_5_VLConfig

    flat = load_model_config(tiny25_dir / "config.json")
    assert (flat.model_type, flat.architecture) == ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration")
    vision = flat.vision
    assert (vision.depth, vision.embed_dim, vision.num_heads, vision.intermediate_size) == (4, 32, 2, 64)
    assert (vision.hidden_size, vision.hidden_act, vision.tokens_per_second) == (64, "silu", 2.0)
    assert (vision.window_size, vision.merged_window_size, vision.fullatt_block_indexes) == (112, 4, (1, 3))
    # The same model saved by transformers 5: text_config nested, vision in_channels and rope_parameters.
    Qwen2_5_VLConfig.from_pretrained(str(tiny25_dir)).save_pretrained(str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "text_config" in raw and "rope_scaling" not in raw and "in_channels" in raw["vision_config"]
    nested = load_model_config(tmp_path / "config.json")
    assert nested.text == flat.text
    assert nested.vision == flat.vision
    assert nested.architecture == flat.architecture


def test_published_3b_values() -> None:
    # Qwen2.5-VL-3B-Instruct's config.json (flat layout) as published, text fields abridged.
    raw = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_attention_heads": 16,
        "num_hidden_layers": 36,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        # The 7B's vision tower, its output at the 3B's width.
        "vision_config": {**QWEN2_5_VL_7B["vision_config"], "out_hidden_size": 2048},
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    }
    config = parse_model_config(raw)
    assert (config.vision.embed_dim, config.vision.head_dim, config.vision.hidden_size) == (1280, 80, 2048)
    assert config.vision.merged_window_size == 4
    assert config.vision.patch_dim == 1176
    # Qwen2-VL keeps its own meaning of the vision fields, and frame-indexed video positions.
    qwen2 = parse_model_config({**raw, "model_type": "qwen2_vl", "architectures": None, "vision_config": {}})
    assert qwen2.architecture == "Qwen2VLForConditionalGeneration"
    assert (qwen2.vision.tokens_per_second, qwen2.vision.window_size, qwen2.vision.hidden_act) == (
        None,
        None,
        "quick_gelu",
    )


def test_bad_configs_say_what_is_wrong() -> None:
    base = {
        "model_type": "qwen2_5_vl",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 10,
    }
    with pytest.raises(ValueError, match="unsupported model_type 'qwen4_vl'; vlmserve runs qwen2_vl and qwen2_5_vl"):
        parse_model_config({**base, "model_type": "qwen4_vl"})
    with pytest.raises(ValueError, match="window_size 14 must be at least"):
        parse_model_config({**base, "vision_config": {"depth": 2, "window_size": 14}})
    with pytest.raises(ValueError, match=r"fullatt_block_indexes \[1, 2\] name blocks outside 0..1"):
        parse_model_config({**base, "vision_config": {"depth": 2, "fullatt_block_indexes": [1, 2]}})
    with pytest.raises(ValueError, match="output width 32 must equal the language model's hidden_size 64"):
        parse_model_config({**base, "vision_config": {"depth": 2, "fullatt_block_indexes": [1], "out_hidden_size": 32}})


# -- the vision tower -----------------------------------------------------------------------------


@pytest.mark.parity
@pytest.mark.parametrize(
    "grids",
    [
        [(1, 8, 12)],  # merged 4 x 6: one full window, one 4 x 2
        [(1, 10, 6), (1, 14, 14), (1, 16, 16)],  # partial windows; 8 x 8 merged: exactly 2 x 2 windows
        [(3, 10, 14), (1, 4, 4)],  # a video's frames, then a one-window image
    ],
)
def test_window_partition_matches_transformers(grids: list[tuple[int, int, int]]) -> None:
    from transformers.vision_utils import get_vision_window_index

    order, cu = window_partition(grids, merge_size=2, window=4)
    ref_order, ref_cu = get_vision_window_index(
        torch.tensor(grids), spatial_merge_size=2, window_size=112, patch_size=14
    )
    assert order.tolist() == ref_order.tolist()
    assert cu == ref_cu.tolist()


@pytest.mark.parity
def test_vision_tower_matches_transformers(tiny25_dir: Path, harness: Harness, hf25_model) -> None:  # type: ignore[no-untyped-def]
    media: list[Image.Image | Video] = [image(8, 12, 1), image(10, 6, 2), SHORT_VIDEO, image(20, 26, 3), LONG_VIDEO]
    prompt = our_prompt(tiny25_dir, chat(IMAGE, IMAGE, VIDEO, IMAGE, VIDEO), media)
    ours = harness.model.embed_multimodal(prompt.mm_items)  # images and videos in one pass
    with torch.no_grad():
        for item, embeds in zip(prompt.mm_items, ours, strict=True):
            grid = torch.tensor([item.grid_thw])
            encode = (
                hf25_model.model.get_image_features if item.modality == "image" else hf25_model.model.get_video_features
            )
            (reference,) = encode(item.pixel_values, grid).pooler_output
            assert embeds.shape == reference.shape
            assert (embeds - reference).abs().max().item() < 1e-5


# -- logits ---------------------------------------------------------------------------------------

# (grid_h, grid_w, seed) in patches; merged grids 7x7 (windows 4x4, 4x3, 3x4, 3x3), 4x6 (4x4, 4x2),
# 5x3 (4x3, 1x3) and 10x13 (rows of 4, 4, 2 by columns of 4, 4, 4, 1 merged tokens).
IMAGE_CASES = {
    "one image 14x14": (chat(IMAGE, "What is this?"), [(14, 14, 1)]),
    "two images 8x12 and 10x6": (chat(IMAGE, "and", IMAGE, "compare them"), [(8, 12, 2), (10, 6, 3)]),
    "image 20x26": (chat("Look:", IMAGE, "describe"), [(20, 26, 4)]),
}


@pytest.mark.parity
@pytest.mark.parametrize("case", list(IMAGE_CASES))
def test_image_logits_match_transformers_float32(
    case: str, tiny25_dir: Path, harness: Harness, hf25_model, hf_tok_and_images
) -> None:  # type: ignore[no-untyped-def]
    text, sizes = IMAGE_CASES[case]
    pictures = [image(*size) for size in sizes]
    prompt = make_processor(tiny25_dir).process(text, [ImageInput(p) for p in pictures])
    assert [item.grid_thw[1:] for item in prompt.mm_items] == [size[:2] for size in sizes]
    ids, vision = hf_mm_prompt_ids(*hf_tok_and_images, text, pictures)
    assert ids == prompt.prompt_token_ids
    reference = hf_mm_logits(hf25_model, ids, vision)
    ours = harness.logits(prompt)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < 1e-4


@pytest.mark.parity
def test_image_and_video_logits_match_transformers_float32(
    tiny25_dir: Path, harness: Harness, hf25_model, hf_tok_and_images
) -> None:  # type: ignore[no-untyped-def]
    """A video short enough in time that transformers' own positions are the reference's."""
    text = chat(IMAGE, "then", VIDEO, "what happens?")
    media: list[Image.Image | Video] = [image(8, 12, 5), SHORT_VIDEO]
    prompt = our_prompt(tiny25_dir, text, media)
    ids, vision = hf_mm_prompt_ids(*hf_tok_and_images, text, hf_media(media))
    assert ids == prompt.prompt_token_ids
    hf_positions, hf_delta = hf25_model.model.get_rope_index(
        torch.tensor([ids]),
        mm_token_type_ids(torch.tensor([ids])),
        vision["image_grid_thw"],
        vision["video_grid_thw"],
        vision["second_per_grid_ts"],
    )
    assert torch.equal(hf_positions[:, 0], prompt.mrope_positions)
    assert int(hf_delta) == prompt.mrope_delta
    video_positions = prompt.mrope_positions[0, prompt.mm_items[1].offset : prompt.mm_items[1].end]
    assert sorted(set(video_positions.tolist())) == [video_positions[0].item(), video_positions[0].item() + 2]
    reference = hf_mm_logits(hf25_model, ids, vision)
    ours = harness.logits(prompt)
    assert (ours - reference).abs().max().item() < 1e-4


@pytest.mark.parity
def test_long_video_chunked_and_decoded_match_transformers_given_positions(
    tiny25_dir: Path, harness: Harness, hf25_model, hf_tok_and_images
) -> None:  # type: ignore[no-untyped-def]
    """Temporal positions past the spatial grid: text resumes one past the largest position (the
    seed; transformers 5.23 resumes earlier, so it is handed our positions). Prefill in chunks
    ending inside the video, then decode steps at positions shifted by mrope_delta."""
    text = chat(VIDEO, "and", IMAGE, "tell me")
    media: list[Image.Image | Video] = [LONG_VIDEO, image(10, 6, 6)]
    prompt = our_prompt(tiny25_dir, text, media)
    video = prompt.mm_items[0]
    start = video.offset  # the video's first position: text before it has one position per token
    assert sorted(set(prompt.mrope_positions[0, video.offset : video.end].tolist())) == [start, start + 4, start + 8]
    assert prompt.mrope_positions[0, video.end].item() == start + 9  # past the last frame, not at start + 3
    ids, vision = hf_mm_prompt_ids(*hf_tok_and_images, text, hf_media(media))
    assert ids == prompt.prompt_token_ids
    hf_positions, _ = hf25_model.model.get_rope_index(
        torch.tensor([ids]),
        mm_token_type_ids(torch.tensor([ids])),
        vision["image_grid_thw"],
        vision["video_grid_thw"],
        vision["second_per_grid_ts"],
    )
    assert not torch.equal(hf_positions[:, 0], prompt.mrope_positions)  # why positions are handed over

    extra = [1234, 77, 151645, 9]
    n = prompt.num_tokens
    positions = torch.cat(
        [prompt.mrope_positions, torch.arange(n, n + len(extra)).expand(3, -1) + prompt.mrope_delta], 1
    )
    reference = hf_mm_logits(hf25_model, ids + extra, vision, position_ids=positions)
    chunks = [video.offset + 5, 9, n - video.offset - 14]
    assert video.offset < chunks[0] < video.end
    ours = harness.logits(prompt, chunks=chunks, extra=extra)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < 1e-4


@pytest.mark.parity
def test_transformers_5x_weight_names(tiny25_dir: Path, tmp_path: Path, harness: Harness, hf25_model) -> None:  # type: ignore[no-untyped-def]
    """The same weights under transformers 5's module names (model.visual.*, model.language_model.*;
    its save_pretrained writes the 4.x names back) load alike."""
    import shutil

    from safetensors.torch import save_file

    state = {name: t.contiguous() for name, t in hf25_model.state_dict().items() if name != "lm_head.weight"}
    assert "model.visual.blocks.0.mlp.gate_proj.bias" in state
    assert "model.language_model.layers.0.mlp.gate_proj.weight" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    shutil.copy(tiny25_dir / "config.json", tmp_path / "config.json")
    prompt = our_prompt(tiny25_dir, chat(IMAGE, "hi"), [image(8, 12, 7)])
    assert torch.equal(Harness(tmp_path).logits(prompt), harness.logits(prompt))


@pytest.mark.parity
def test_untied_nested_sharded_checkpoint(tmp_path: Path, hf_tok_and_images) -> None:  # type: ignore[no-untyped-def]
    """transformers 5's nested config, an untied lm_head and two shards, as `vlmserve make-tiny
    --arch qwen2_5_vl --nested-config --untied --shards 2` writes them."""
    from dataclasses import replace

    from transformers import Qwen2_5_VLForConditionalGeneration

    from vlmserve.families.qwen2_vl.tiny import QWEN2_5_VL_SPEC, write_tiny_qwen2_vl

    spec = replace(QWEN2_5_VL_SPEC, tie_word_embeddings=False)
    model_dir = write_tiny_qwen2_vl(tmp_path / "untied", spec, seed=1, nested_config=True, num_shards=2)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert not hf.config.tie_word_embeddings
    text = chat(IMAGE, "then", VIDEO, "what happens?")
    media: list[Image.Image | Video] = [image(10, 6, 12), SHORT_VIDEO]
    prompt = our_prompt(model_dir, text, media)
    ids, vision = hf_mm_prompt_ids(*hf_tok_and_images, text, hf_media(media))
    assert (Harness(model_dir).logits(prompt) - hf_mm_logits(hf, ids, vision)).abs().max().item() < 1e-4


def test_missing_vision_mlp_weight_is_named(tiny25_dir: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny25_dir, broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["visual.blocks.2.mlp.up_proj.bias"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks weights: \['visual.blocks.2.mlp.gate_up_proj.bias#1'\]"):
        Harness(broken)


# -- greedy decoding through the engine ----------------------------------------------------------

MAX_NEW = 8


@pytest.fixture(scope="module")
def llm(tiny25_dir: Path):  # type: ignore[no-untyped-def]
    from vlmserve import LLM

    return LLM(
        tiny25_dir, dtype="float32", max_model_len=1024, kv_cache_memory_gib=0.02, limit_mm_per_prompt={"image": 2}
    )


@pytest.mark.parity
@pytest.mark.parametrize(
    "case",
    [
        # Images alone: the families' conformance suite (tests/families).
        ("video", chat(VIDEO, "What happens?"), [SHORT_VIDEO]),
        ("image and video", chat(IMAGE, VIDEO, "Same place?"), [(8, 12, 11), SHORT_VIDEO]),
    ],
    ids=lambda case: case[0],
)
def test_greedy_matches_transformers_generate(
    case: tuple, tiny25_dir: Path, llm, hf25_model, hf_tok_and_images
) -> None:  # type: ignore[no-untyped-def]
    """Through the engine (scheduler, encoder, paged KV): decode positions come from mrope_delta."""
    from vlmserve import SamplingParams

    _, text, spec = case
    media: list[Image.Image | Video] = [m if isinstance(m, Video) else image(*m) for m in spec]
    prompt = our_prompt(tiny25_dir, text, media)
    ids, vision = hf_mm_prompt_ids(*hf_tok_and_images, text, hf_media(media))
    assert ids == prompt.prompt_token_ids
    expected = hf_mm_greedy(hf25_model, ids, vision, MAX_NEW)
    (final,) = [out for out in llm.stream(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW)) if out.finished]
    assert final.outputs[0].token_ids == expected
