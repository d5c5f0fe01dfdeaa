"""Qwen-VL-Chat behind the real server: chat with images and history answers as the offline API
does, and images named inside <img>...</img> are fetched only through the guarded fetcher."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.api.conftest import Server, data_url, picture
from tests.api.test_bad_inputs import check_error
from tests.api.upstream import serve
from vlmserve import LLM, SamplingParams


def history_messages() -> list[dict]:
    return [
        {"role": "system", "content": "You are a careful assistant."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(picture(4, (150, 100)))}},
                {"type": "text", "text": "What is it?"},
            ],
        },
        {"role": "assistant", "content": "<ref>A square</ref><box>(100,200),(500,900)</box>"},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(picture(5, (60, 90)))}},
                {"type": "text", "text": "And here?"},
            ],
        },
    ]


def test_chat_with_images_and_history_answers_as_the_offline_api(qwen_server: Server, tiny_qwen_vl_dir: Path) -> None:
    client = openai.OpenAI(base_url=qwen_server.url + "/v1", api_key=qwen_server.api_key, max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=history_messages(), max_tokens=5, temperature=0)
    extension = (reply.model_extra or {})["vlmserve"]
    assert extension["grounding_convention"] == "qwen-vl"
    assert [item["original_size"] for item in extension["mm_items"]] == [[150, 100], [60, 90]]
    assert [item["resized_size"] for item in extension["mm_items"]] == [[448, 448], [448, 448]]

    llm = LLM(tiny_qwen_vl_dir, dtype="float32", max_model_len=4096, kv_cache_memory_gib=0.02)
    (offline,) = llm.chat(history_messages(), SamplingParams(temperature=0, max_tokens=5))
    assert reply.usage.prompt_tokens == len(offline.prompt_token_ids) > 2 * 256
    assert reply.choices[0].message.content == offline.outputs[0].text


def test_image_urls_inside_the_prompt_go_through_the_fetch_guard(qwen_server: Server) -> None:
    httpd, hits = serve()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/ok.png"
        response = qwen_server.post("/v1/completions", {"prompt": f"<img>{url}</img>\nWhat is it?", "max_tokens": 2})
    finally:
        httpd.shutdown()
    check_error(qwen_server, response, 400, "private|loopback|not allowed")
    assert hits == []  # refused before any connection
    local = qwen_server.post("/v1/completions", {"prompt": "<img>/etc/hostname</img>\nWhat?", "max_tokens": 2})
    check_error(qwen_server, local, 400, "local files are not allowed")


def test_a_video_is_refused_for_this_family(qwen_server: Server) -> None:
    content = [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, {"type": "text", "text": "?"}]
    response = qwen_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}]})
    check_error(qwen_server, response, 400, "video")
