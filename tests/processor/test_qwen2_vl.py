"""Prompt processing against transformers: same token ids, same pixels, same positions."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.reference import hf_prompt_ids
from vlmserve.families.qwen2_vl.processor import Qwen2VLProcessor
from vlmserve.model_files import read_json
from vlmserve.multimodal.image import ImageProcessorConfig
from vlmserve.multimodal.media import MediaError
from vlmserve.processor.base import ImageInput, ProcessorLimits
from vlmserve.processor.chat import parse_chat_messages
from vlmserve.registry import load_model_config
from vlmserve.tokenizer import Tokenizer


def make_processor(tiny_dir: Path, max_model_len: int = 32768, max_images: int = 4) -> Qwen2VLProcessor:
    return Qwen2VLProcessor(
        load_model_config(tiny_dir / "config.json"),
        Tokenizer(tiny_dir),
        ImageProcessorConfig.from_dict(read_json(tiny_dir / "preprocessor_config.json")),
        ProcessorLimits(max_model_len, {"image": max_images}),
    )


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def conversations(images: dict[str, Image.Image]) -> list[list[dict]]:
    return [
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": images["wide"]}, {"type": "text", "text": "Describe."}],
            }
        ],
        [
            {"role": "system", "content": "Be terse."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "First"},
                    {"type": "image_url", "image_url": {"url": _data_url(images["tall"])}},
                    {"type": "text", "text": "then"},
                    {"type": "image", "image": images["odd"]},
                    {"type": "text", "text": "which is brighter?"},
                ],
            },
        ],
        [{"role": "user", "content": "No pictures today."}],
    ]


def test_token_ids_pixels_and_positions_match_transformers(
    tiny_dir: Path,
    images,
    hf_tokenizer,
    hf_image_processor,
    hf_model,  # type: ignore[no-untyped-def]
) -> None:
    processor = make_processor(tiny_dir)
    for conv in conversations(images):
        rendered, inputs, _ = parse_chat_messages(conv)
        text = processor.tokenizer.apply_chat_template(rendered)
        ours = processor.process(text, inputs)
        pil = [
            Image.open(io.BytesIO(base64.b64decode(i.source.split(",", 1)[1])))
            if isinstance(i.source, str)
            else i.source
            for i in inputs
        ]
        theirs_ids, vision = hf_prompt_ids(hf_tokenizer, hf_image_processor, text, pil)
        assert ours.prompt_token_ids == theirs_ids
        assert [item.grid_thw for item in ours.mm_items] == [
            tuple(g.tolist()) for g in vision.get("image_grid_thw", [])
        ]
        if pil:
            pixels = torch.cat([item.pixel_values for item in ours.mm_items])
            assert (pixels - vision["pixel_values"]).abs().max() <= 1e-6
            ids = torch.tensor([theirs_ids])
            positions, delta = hf_model.model.get_rope_index(ids, (ids == 151655).int(), vision["image_grid_thw"])
            assert torch.equal(ours.mrope_positions, positions[:, 0])
            assert ours.mrope_delta == int(delta)
        for item in ours.mm_items:  # each item covers exactly its run of placeholders
            assert set(ours.prompt_token_ids[item.offset : item.end]) == {151655}
            assert ours.prompt_token_ids[item.offset - 1] == 151652 and ours.prompt_token_ids[item.end] == 151653


def test_seed_001_placeholder_count(tiny_dir: Path) -> None:
    processor = make_processor(tiny_dir)
    square = Image.new("RGB", (392, 392), (200, 10, 10))
    prompt = processor.process("<|vision_start|><|image_pad|><|vision_end|>hi", [ImageInput(square)])
    (item,) = prompt.mm_items
    assert item.grid_thw == (1, 28, 28) and item.length == 196
    assert prompt.prompt_token_ids.count(151655) == 196
    assert prompt.num_tokens == 196 + 3


def test_openai_and_qwen_parts_are_the_same_prompt(tiny_dir: Path, images) -> None:  # type: ignore[no-untyped-def]
    processor = make_processor(tiny_dir)
    url = _data_url(images["small"])
    openai = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]}
    ]
    qwen = [{"role": "user", "content": [{"image": url}, {"text": "?"}]}]
    prompts = []
    for conv in (openai, qwen):
        rendered, inputs, _ = parse_chat_messages(conv)
        prompts.append(processor.process(processor.tokenizer.apply_chat_template(rendered), inputs))
    assert prompts[0].prompt_token_ids == prompts[1].prompt_token_ids
    assert prompts[0].mm_items[0].content_hash == prompts[1].mm_items[0].content_hash


def test_per_item_sizing_from_messages(tiny_dir: Path, images) -> None:  # type: ignore[no-untyped-def]
    processor = make_processor(tiny_dir)
    conv = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": images["wide"], "resized_height": 56, "resized_width": 112},
                {"type": "image_url", "image_url": {"url": _data_url(images["wide"]), "max_pixels": 3136}},
                {"type": "text", "text": "?"},
            ],
        }
    ]
    rendered, inputs, _ = parse_chat_messages(conv)
    prompt = processor.process(processor.tokenizer.apply_chat_template(rendered), inputs)
    # 150x100 under max_pixels 3136: scaled by sqrt(15000 / 3136) and floored to 56x28.
    assert [item.grid_thw for item in prompt.mm_items] == [(1, 4, 8), (1, 2, 4)]
    assert [item.length for item in prompt.mm_items] == [8, 2]


def test_errors_name_what_is_wrong(tiny_dir: Path, images) -> None:  # type: ignore[no-untyped-def]
    processor = make_processor(tiny_dir, max_model_len=64, max_images=2)
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    with pytest.raises(ValueError, match="holds 1 <\\|image_pad\\|> placeholder\\(s\\) but 2 image\\(s\\)"):
        processor.process(pad, [ImageInput(images["small"]), ImageInput(images["small"])])
    with pytest.raises(ValueError, match="too many images: 3 given, at most 2"):
        processor.process(pad * 3, [ImageInput(images["small"])] * 3)
    with pytest.raises(ValueError, match=r"prompt needs 100 tokens \(4 text \+ 96 image\).*max_model_len=64"):
        processor.process(pad * 2, [ImageInput(Image.new("RGB", (224, 168)))] * 2)  # 8 x 6 merged each
    with pytest.raises(MediaError, match=r"big: the image needs 154 tokens, at most 63 per image"):
        processor.process(pad, [ImageInput(Image.new("RGB", (400, 300)), label="big")])
    with pytest.raises(ValueError, match=r"holds 1 <\|video_pad\|> placeholder\(s\) but 0 video\(s\)"):
        processor.process("<|vision_start|><|video_pad|><|vision_end|>", [])
    with pytest.raises(MediaError, match="^cat picture: file not found"):
        processor.process(pad, [ImageInput("/nope.png", label="cat picture")])
    with pytest.raises(MediaError, match="^thin: image aspect ratio 300.0"):
        processor.process(pad, [ImageInput(Image.new("RGB", (300, 1)), label="thin")])
