"""The server tells each image's size as sent and as the model saw it (the `vlmserve` extension
field), so a client can map grounding boxes back to its own pixels."""

from __future__ import annotations

import json

import openai
import pytest

from tests.api.conftest import Server, data_url, picture
from vlmserve.grounding import parse_boxes
from vlmserve.registry import grounding_convention


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


def two_images() -> list[dict]:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(picture(1, (150, 100)))}},
        {"type": "image_url", "image_url": {"url": data_url(picture(2, (70, 190)))}},
        {"type": "text", "text": "Where is the cat?"},
    ]
    return [{"role": "user", "content": content}]


# smart_resize: 150 x 100 -> 140 x 112, 70 x 190 -> 56 x 196 (70 / 28 = 2.5 rounds to even).
EXPECTED = {
    "grounding_convention": "qwen2-vl",
    "mm_items": [
        {"modality": "image", "original_size": [150, 100], "resized_size": [140, 112]},
        {"modality": "image", "original_size": [70, 190], "resized_size": [56, 196]},
    ],
}


def test_chat_response_carries_the_sizes(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=two_images(), max_tokens=2, temperature=0)
    extension = (reply.model_extra or {})["vlmserve"]
    assert extension == EXPECTED
    # What a client does with it: the second image's boxes, in its own pixels.
    item = extension["mm_items"][1]
    (box,) = parse_boxes(
        "<|box_start|>(500,500),(1000,1000)<|box_end|>",
        grounding_convention(extension["grounding_convention"]),
        tuple(item["original_size"]),
        tuple(item["resized_size"]),
    )
    assert box.xyxy == (35, 95, 70, 190)


def test_chat_stream_carries_the_sizes_in_its_first_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=two_images(), max_tokens=3, temperature=0, n=2, stream=True
    )
    chunks = list(stream)
    assert (chunks[0].model_extra or {})["vlmserve"] == EXPECTED
    assert all("vlmserve" not in (c.model_extra or {}) for c in chunks[1:])


def test_completions_carry_the_field_too(server: Server) -> None:
    body = {"model": "tiny", "prompt": ["Hello", "World"], "max_tokens": 2}
    reply = server.post("/v1/completions", body).json()
    assert reply["vlmserve"] == {"grounding_convention": "qwen2-vl", "mm_items": []}  # text prompts only
    text = server.post("/v1/completions", body | {"stream": True}).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert len(events) >= 2
    assert events[0]["vlmserve"] == {"grounding_convention": "qwen2-vl", "mm_items": []}
    assert all("vlmserve" not in e for e in events[1:])
