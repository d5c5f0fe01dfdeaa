"""QwenVLProcessor: images from the <img> spans, the reference's 448 bicubic + CLIP preprocessing, 1-D
positions, limits and errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlmserve.families.qwen_vl.chat_format import chat_prompt
from vlmserve.families.qwen_vl.processor import QwenVLProcessor, check_image_items, positions
from vlmserve.families.qwen_vl.tokenizer import QwenVLTokenizer
from vlmserve.multimodal.image import ImageSizing
from vlmserve.multimodal.inputs import MultiModalItem
from vlmserve.multimodal.media import MediaError
from vlmserve.processor.base import ImageInput, ProcessorLimits, VideoInput

# The reference: transforms.Normalize(mean, std) after a 448 x 448 bicubic resize and ToTensor.
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


def seed_pixels(image: Image.Image) -> torch.Tensor:
    """[3, 448, 448] as the seed describes: convert("RGB"), Resize((448, 448), BICUBIC), ToTensor
    (uint8 / 255 in float32), Normalize (x - mean) / std, in torch as torchvision computes it."""
    resized = image.convert("RGB").resize((448, 448), Image.Resampling.BICUBIC)
    x = torch.from_numpy(np.array(resized)).permute(2, 0, 1).float().div(255)
    return (x - torch.tensor(MEAN)[:, None, None]) / torch.tensor(STD)[:, None, None]


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    gradient = np.linspace(0, 255, width, dtype=np.float32)[None, :, None] * np.ones((height, 1, 3))
    noise = rng.integers(0, 60, (height, width, 3))
    return Image.fromarray(np.clip(gradient + noise, 0, 255).astype(np.uint8))


@pytest.fixture
def images(tmp_path: Path) -> dict[str, Path]:
    paths = {"wide": tmp_path / "wide.png", "tall": tmp_path / "tall.jpg", "rgba": tmp_path / "rgba.png"}
    photo(640, 360).save(paths["wide"])
    photo(300, 700, seed=1).save(paths["tall"], quality=95)
    rgba = photo(100, 100, seed=2).convert("RGBA")
    rgba.putalpha(128)
    rgba.save(paths["rgba"])
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    return paths


def make_processor(tok: QwenVLTokenizer, max_model_len: int = 8192, max_images: int = 4) -> QwenVLProcessor:
    return QwenVLProcessor(tok, ProcessorLimits(max_model_len, {"image": max_images}))


def test_items_and_pixels_from_spans(qwen_vl_tokenizer: QwenVLTokenizer, images: dict[str, Path]) -> None:
    proc = make_processor(qwen_vl_tokenizer)
    text = f"Picture 1: <img>{images['wide']}</img>\nPicture 2: <img>{images['tall']}</img>\nSame?"
    out = proc.process(text)
    ids = out.prompt_token_ids
    assert ids == qwen_vl_tokenizer.encode(text) and out.prompt == text
    assert [item.offset for item in out.mm_items] == [i + 1 for i, t in enumerate(ids) if t == 151857]
    for item, name, size in zip(out.mm_items, ["wide", "tall"], [(640, 360), (300, 700)], strict=True):
        assert ids[item.offset - 1] == 151857 and ids[item.end] == 151858
        assert (item.modality, item.length, item.grid_thw) == ("image", 256, (1, 32, 32))
        assert (item.original_size, item.resized_size) == (size, (448, 448))
        assert item.pixel_values.dtype == torch.float32 and item.pixel_values.shape == (3, 448, 448)
        expected = seed_pixels(Image.open(images[name]))
        torch.testing.assert_close(item.pixel_values, expected, rtol=0, atol=1e-6)
    assert out.mm_items[0].content_hash != out.mm_items[1].content_hash
    # The same prompt as token ids gives the same result.
    again = proc.process(ids)
    assert again.prompt is None and again.prompt_token_ids == ids
    assert torch.equal(again.mm_items[1].pixel_values, out.mm_items[1].pixel_values)


def test_rgba_is_converted_like_the_reference(qwen_vl_tokenizer: QwenVLTokenizer, images: dict[str, Path]) -> None:
    out = make_processor(qwen_vl_tokenizer).process(f"<img>{images['rgba']}</img>")
    # PIL's convert("RGB") drops alpha (no compositing onto white), as the reference does.
    torch.testing.assert_close(out.mm_items[0].pixel_values, seed_pixels(Image.open(images["rgba"])), rtol=0, atol=1e-6)


def test_positions(qwen_vl_tokenizer: QwenVLTokenizer, images: dict[str, Path]) -> None:
    out = make_processor(qwen_vl_tokenizer).process(f"Picture 1: <img>{images['wide']}</img>\nwhat is it?")
    n = out.num_tokens
    pos = out.mrope_positions
    assert pos is not None and pos.shape == (3, n) and pos.dtype == torch.int64
    assert torch.equal(pos[0], torch.arange(n)) and torch.equal(pos[2], torch.arange(n))
    assert torch.equal(pos[1], torch.full((n,), n - 1))  # + 1: the length the reference saw for every prompt token
    assert out.mrope_delta == 0
    rebuilt, delta = positions(n, out.mm_items)
    assert torch.equal(rebuilt, pos) and delta == 0
    assert positions(1)[0].tolist() == [[0], [0], [0]]
    # Decoded tokens keep the prompt's length for NTK (the reference caches ntk_alpha at prefill),
    # also when a preempted request recomputes them together with its prompt: the model's rule,
    # applied by the runner past the prompt's own positions.
    from vlmserve.engine.request_state import CachedRequestState
    from vlmserve.families.qwen_vl.model import QWenLMHeadModel
    from vlmserve.ipc.contracts import NewRequestData
    from vlmserve.sampling_params import SamplingParams

    decoded = QWenLMHeadModel.decode_positions(n, n + 3, out.mrope_delta, n)
    assert decoded.tolist() == [[n, n + 1, n + 2], [n - 1] * 3, [n, n + 1, n + 2]]
    state = CachedRequestState.from_new(
        NewRequestData(
            request_id="r",
            prompt_token_ids=out.prompt_token_ids,
            mm_items=out.mm_items,
            mrope_positions=out.mrope_positions,
            mrope_delta=out.mrope_delta,
            sampling_params=SamplingParams(max_tokens=4),
            block_ids=[],
            num_computed_tokens=0,
        )
    )
    whole = state.positions(0, n + 3, QWenLMHeadModel.decode_positions)
    assert torch.equal(whole, torch.cat([pos, decoded], dim=1))


def test_explicit_images_fill_the_spans(qwen_vl_tokenizer: QwenVLTokenizer, images: dict[str, Path]) -> None:
    tok = qwen_vl_tokenizer
    proc = make_processor(tok)
    pil = Image.open(images["tall"])
    messages = [
        {"role": "user", "content": [{"type": "image", "image": pil}, {"type": "text", "text": "what?"}]},
        {"role": "assistant", "content": "a picture"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(images["wide"])}}, "and this?"]},
    ]
    prompt = chat_prompt(tok, messages)
    out = proc.process(prompt.token_ids, prompt.images)
    assert out.prompt_token_ids == prompt.token_ids
    assert [item.original_size for item in out.mm_items] == [(300, 700), (640, 360)]
    torch.testing.assert_close(out.mm_items[0].pixel_values, seed_pixels(pil), rtol=0, atol=1e-6)
    # An image given as itself and the same image named in a span are the same encoder input.
    by_url = proc.process(f"<img>{images['wide']}</img>")
    assert by_url.mm_items[0].content_hash == out.mm_items[1].content_hash
    with pytest.raises(ValueError, match="holds 2 <img>...</img> span\\(s\\) but 1 image\\(s\\) were given"):
        proc.process(prompt.token_ids, prompt.images[:1])
    with pytest.raises(ValueError, match="holds 0 <img>"):
        proc.process("describe", [ImageInput(pil)])
    with pytest.raises(ValueError, match="resizes every image to 448x448"):
        proc.process("<img></img>", [ImageInput(pil, ImageSizing(max_pixels=1000), label="im")])


def test_limits_and_planner_interface(qwen_vl_tokenizer: QwenVLTokenizer, images: dict[str, Path]) -> None:
    proc = make_processor(qwen_vl_tokenizer, max_model_len=600, max_images=2)
    assert proc.max_items_per_prompt() == {"image": 2, "video": 0}
    assert proc.max_tokens_per_item() == {"image": 256}
    (dummy,) = proc.dummy_items(1, 256)
    assert (dummy.length, dummy.grid_thw, dummy.pixel_values.shape) == (256, (1, 32, 32), (3, 448, 448))
    with pytest.raises(ValueError, match="no video input"):
        proc.dummy_items(1, 256, "video")
    span = f"<img>{images['wide']}</img>"
    with pytest.raises(
        ValueError, match="too many images: 3 given, at most 2 per prompt \\(the first one over: image 3"
    ):
        proc.process(span * 3)
    with pytest.raises(ValueError, match="prompt needs 774 tokens \\(3 image\\(s\\) of 256\\).*max_model_len=600"):
        make_processor(qwen_vl_tokenizer, max_model_len=600).process(span * 3)
    with pytest.raises(ValueError, match="Qwen-VL-Chat has no video input"):
        proc.process("hi", [], [VideoInput("a.mp4")])


@pytest.mark.parametrize(
    ("prompt", "error", "match"),
    [
        ("Picture 1: <img>{missing}</img>\n", MediaError, "image 1 \\(<img>.*missing.png</img>\\): file not found"),
        ("<img>{ok}</img><img>{broken}</img>", MediaError, "image 2 \\(<img>.*broken.png</img>\\): cannot decode"),
        ("Picture 1: <img></img>\n", MediaError, "image 1 .*names no image"),
        ("<img>https://example.com/" + "a" * 240 + "</img>", ValueError, "at most 256 bytes"),
        ("<img>a.png", ValueError, "unclosed <img>"),
        ("", ValueError, "the prompt is empty"),
    ],
)
def test_errors_name_the_image(
    qwen_vl_tokenizer: QwenVLTokenizer, images: dict[str, Path], prompt: str, error: type, match: str
) -> None:
    folder = images["wide"].parent
    text = prompt.format(missing=folder / "missing.png", ok=images["wide"], broken=folder / "broken.png")
    with pytest.raises(error, match=match):
        make_processor(qwen_vl_tokenizer).process(text)


def test_malformed_token_ids(qwen_vl_tokenizer: QwenVLTokenizer, images: dict[str, Path]) -> None:
    proc = make_processor(qwen_vl_tokenizer)
    ids = qwen_vl_tokenizer.encode(f"a <img>{images['wide']}</img> b")
    start = ids.index(151857)
    with pytest.raises(ValueError, match="must be followed by 256 positions and </img>"):
        proc.process(ids[: start + 1] + ids[start + 2 :])  # 255 positions
    with pytest.raises(ValueError, match="</img> at position 1 closes no <img>"):
        proc.process([64, 151858])
    with pytest.raises(ValueError, match="must be in 0..151859; position 1 holds 151860"):
        proc.process([64, 151860])
    assert QwenVLProcessor(qwen_vl_tokenizer, ProcessorLimits(100), vocab_size=151936).process([151935]).num_tokens == 1


def test_check_image_items(qwen_vl_tokenizer: QwenVLTokenizer, images: dict[str, Path]) -> None:
    out = make_processor(qwen_vl_tokenizer).process(f"x <img>{images['wide']}</img> y")
    ids, items = out.prompt_token_ids, out.mm_items
    check_image_items(ids, items, 151857)
    moved = MultiModalItem(**{**items[0].__dict__, "offset": items[0].offset + 1})
    with pytest.raises(ValueError, match="do not match the <img> spans"):
        check_image_items(ids, [moved], 151857)
    with pytest.raises(ValueError, match="do not match"):
        check_image_items(ids, [], 151857)
    with pytest.raises(ValueError, match="not closed by </img>"):
        check_image_items(ids[:-3], items, 151857)


def test_prompts_past_seq_length_get_a_cache_salt_naming_their_rotary_base(qwen_vl_tokenizer: QwenVLTokenizer) -> None:
    """Past seq_length a prompt's KV depends on its length (dynamic NTK): two prompts sharing a
    first block but differing in ntk_alpha must not share cached KV."""
    from vlmserve.engine.kv_cache import KVCacheManager
    from vlmserve.engine.request import Request
    from vlmserve.sampling_params import SamplingParams

    proc = QwenVLProcessor(qwen_vl_tokenizer, ProcessorLimits(8192, {"image": 1}), ntk_seq_length=16)
    base = list(range(1000, 1016))
    short = proc.process(base)  # 16 tokens: alpha 1
    longer = proc.process(base + list(range(2000, 2010)))  # 26 tokens: alpha 3
    longest = proc.process(base + list(range(2000, 2020)))  # 36 tokens: alpha 7
    assert [p.cache_salt for p in (short, longer, longest)] == [None, "ntk-alpha-3", "ntk-alpha-7"]
    assert QwenVLProcessor(qwen_vl_tokenizer, ProcessorLimits(8192, {"image": 1})).process(base * 3).cache_salt is None

    kv = KVCacheManager(num_blocks=16, block_size=16)
    first = [
        kv.block_hashes(Request(str(k), p, SamplingParams(max_tokens=1), frozenset(), 8192), 1)[0]
        for k, p in enumerate((short, longer, longest))
    ]
    assert len(set(first)) == 3  # same 16 tokens, three rotary bases
