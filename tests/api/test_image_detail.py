"""OpenAI's image `detail` as a pixel budget: "low" is LOW_DETAIL_TOKENS tokens of the family's
patch_size * merge_size pixels, "high" and "auto" the server's max_pixels; an item's own
min_pixels / max_pixels win over it. The usage's multimodal_tokens say what each image took."""

from __future__ import annotations

import httpx
import pytest

from tests.api.conftest import Server, data_url, picture
from vlmserve.multimodal.image import LOW_DETAIL_TOKENS, ImageProcessorConfig, ImageSizing, target_size

SIDE = 1024


def test_low_is_256_tokens_of_each_familys_token_size() -> None:
    assert LOW_DETAIL_TOKENS == 256
    qwen2 = ImageProcessorConfig(patch_size=14, merge_size=2, max_pixels=12845056)  # 28-pixel tokens
    qwen3 = ImageProcessorConfig(patch_size=16, merge_size=2, max_pixels=16777216)  # 32-pixel tokens
    low = ImageSizing(detail="low")
    assert target_size(SIDE, SIDE, qwen2, low) == (448, 448)  # 16 x 16 tokens of 28 x 28 pixels
    assert target_size(SIDE, SIDE, qwen3, low) == (512, 512)  # 16 x 16 tokens of 32 x 32 pixels
    # A small image is not enlarged to the budget.
    assert target_size(100, 100, qwen2, low) == (112, 112)
    # "high", "auto" and no detail: the server's max_pixels (1024 rounds to 37 tokens of 28).
    for sizing in (ImageSizing(detail="high"), ImageSizing(detail="auto"), ImageSizing()):
        assert target_size(SIDE, SIDE, qwen2, sizing) == (37 * 28, 37 * 28)


def test_an_items_own_pixels_win_over_detail() -> None:
    cfg = ImageProcessorConfig(patch_size=14, merge_size=2, max_pixels=12845056)
    # max_pixels of the item's own: 20 x 20 tokens, above the low budget.
    assert target_size(SIDE, SIDE, cfg, ImageSizing(max_pixels=400 * 28 * 28, detail="low")) == (560, 560)
    # min_pixels above the low budget: honoured, the budget raised to it.
    assert target_size(SIDE, SIDE, cfg, ImageSizing(min_pixels=24 * 24 * 28 * 28, detail="low")) == (672, 672)
    # max_pixels below the budget with detail high: the item's.
    assert target_size(SIDE, SIDE, cfg, ImageSizing(max_pixels=8 * 8 * 28 * 28, detail="high")) == (224, 224)


def image_tokens(server: Server, image_url: dict, **part: object) -> dict:
    content = [{"type": "image_url", "image_url": image_url, **part}, {"type": "text", "text": "?"}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    (item,) = r.json()["usage"]["multimodal_tokens"]
    return item


@pytest.fixture(scope="module")
def big_image() -> str:
    return data_url(picture(3, (SIDE, SIDE)))


def test_detail_sets_the_tokens_an_image_takes_qwen2_vl(server: Server, big_image: str) -> None:
    low = image_tokens(server, {"url": big_image, "detail": "low"})
    assert (low["tokens"], low["resized_size"], low["original_size"]) == (256, [448, 448], [SIDE, SIDE])
    for detail in ("high", "auto"):
        item = image_tokens(server, {"url": big_image, "detail": detail})
        assert (item["tokens"], item["resized_size"]) == (37 * 37, [37 * 28, 37 * 28])
    # The item's own max_pixels wins (beside the part, qwen-vl-utils' way).
    own = image_tokens(server, {"url": big_image, "detail": "low"}, max_pixels=20 * 20 * 28 * 28)
    assert own["tokens"] == 400


def test_detail_low_on_qwen3_vl_is_256_tokens_of_32_pixels(qwen3_server: Server, big_image: str) -> None:
    low = image_tokens(qwen3_server, {"url": big_image, "detail": "low"})
    assert (low["tokens"], low["resized_size"]) == (256, [512, 512])


def test_qwen_vl_chat_takes_detail_and_keeps_its_fixed_size(qwen_server: Server) -> None:
    """Qwen-VL-Chat sees every image at 448x448 (256 tokens): detail is accepted and changes nothing."""
    item = image_tokens(qwen_server, {"url": data_url(picture(3, (300, 200))), "detail": "low"})
    assert (item["tokens"], item["resized_size"]) == (256, [448, 448])


def test_an_unknown_detail_is_a_400_naming_the_choices(server: Server) -> None:
    content = [{"type": "image_url", "image_url": {"url": data_url(picture()), "detail": "medium"}}]
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "max_tokens": 1})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "detail must be one of low, high, auto, original" in message and "'medium'" in message
    assert httpx.get(server.url + "/health").status_code == 200
