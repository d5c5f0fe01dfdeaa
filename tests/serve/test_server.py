"""The real server on loopback, driven by the official openai client and by raw HTTP; answers
compared with the offline engine on the same checkpoint."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import openai
import pytest

from tests.serve.conftest import Server, data_url, image_message, picture, segments_left
from vlmserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_dir: Path) -> LLM:
    return LLM(tiny_dir, dtype="float32", max_model_len=4096, kv_cache_memory_gib=0.05)


def offline_tokens(llm: LLM, messages: list[dict], max_tokens: int) -> tuple[str, list[int]]:
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0]
    return out.text, out.token_ids


def test_chat_with_an_image_matches_the_offline_engine(client: openai.OpenAI, offline: LLM) -> None:
    messages = image_message(data_url(picture(1)), "Describe the picture.")
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    text, tokens = offline_tokens(offline, messages, 12)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason in ("length", "stop")
    usage = reply.usage
    assert usage is not None and usage.completion_tokens == len(tokens)
    extra = usage.model_extra or {}
    ((item),) = extra["multimodal_tokens"]
    assert (
        item["modality"] == "image" and item["tokens"] == 12 and item["original_size"] == [120, 80]
    )  # 112 x 84 after smart_resize
    assert segments_left() == []


def test_streaming_gives_the_same_text_and_a_usage_chunk(client: openai.OpenAI, offline: LLM) -> None:
    messages = image_message(data_url(picture(2)), "Stream it.")
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    text, tokens = offline_tokens(offline, messages, 16)
    assert "".join(pieces) == text and finish in ("length", "stop")
    assert usage is not None and usage.completion_tokens == len(tokens)


def test_sampling_options(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me something."}]
    a = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=10,
        n=3,
        seed=7,
        temperature=1.0,
        top_p=1.0,
        extra_body={"top_k": 0},  # unset fields take generation_config.json's defaults (top_k=1), as in vLLM
    )
    b = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=10,
        n=3,
        seed=7,
        temperature=1.0,
        top_p=1.0,
        extra_body={"top_k": 0},  # unset fields take generation_config.json's defaults (top_k=1), as in vLLM
    )
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1
    greedy = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    stop = greedy.choices[0].message.content[3:6]
    cut = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == greedy.choices[0].message.content.split(stop)[0]


def test_logprobs_equal_the_offline_engines_in_chat_stream_and_completions(client: openai.OpenAI, offline: LLM) -> None:
    """The offline engine's logprobs are checked against transformers (entrypoints/test_llm.py);
    the server must carry the same numbers: the sampled token's own logprob (sampling at
    temperature 0.7 among the top 3 picks tokens that are not the most likely), its
    alternatives in rank order, each with its own bytes."""
    sampling = {"temperature": 0.7, "top_p": 1.0, "seed": 5, "max_tokens": 6}
    params = SamplingParams(top_k=3, **sampling)
    tokenizer = offline.get_tokenizer()

    messages = [{"role": "user", "content": "hi"}]
    ref = offline.chat(messages, dataclasses.replace(params, logprobs=4))[0].outputs[0]
    assert ref.logprobs is not None
    assert max(entry[t].rank or 0 for t, entry in zip(ref.token_ids, ref.logprobs, strict=True)) > 1
    expected = []
    for token_id, entry in zip(ref.token_ids, ref.logprobs, strict=True):
        ranked = sorted((lp.rank or 0, tid, lp) for tid, lp in entry.items() if (lp.rank or 0) <= 4)
        assert [rank for rank, _, _ in ranked] == [1, 2, 3, 4]
        expected.append(
            (
                entry[token_id].decoded_token,
                pytest.approx(entry[token_id].logprob, abs=1e-4),
                list(tokenizer.token_bytes(token_id)),
                [
                    (lp.decoded_token, pytest.approx(lp.logprob, abs=1e-4), list(tokenizer.token_bytes(tid)))
                    for _, tid, lp in ranked
                ],
            )
        )

    def shown(tokens) -> list:  # type: ignore[no-untyped-def]
        return [(t.token, t.logprob, t.bytes, [(a.token, a.logprob, a.bytes) for a in t.top_logprobs]) for t in tokens]

    body = {"model": "tiny", "messages": messages, "logprobs": True, "top_logprobs": 4, "extra_body": {"top_k": 3}}
    reply = client.chat.completions.create(**body, **sampling)
    assert reply.choices[0].message.content == ref.text
    assert shown(reply.choices[0].logprobs.content) == expected
    streamed = []
    for chunk in client.chat.completions.create(**body, **sampling, stream=True):
        for choice in chunk.choices:
            streamed.extend(choice.logprobs.content if choice.logprobs else [])
    assert shown(streamed) == expected

    prompt = "Once upon a time"
    ref = offline.generate(prompt, dataclasses.replace(params, logprobs=1))[0].outputs[0]
    assert ref.logprobs is not None
    sampled = [entry[t] for t, entry in zip(ref.token_ids, ref.logprobs, strict=True)]
    assert max(lp.rank or 0 for lp in sampled) > 1
    legacy = client.completions.create(
        model="tiny", prompt=prompt, logprobs=1, extra_body={"top_k": 3}, **sampling
    ).choices[0]
    assert legacy.text == ref.text and legacy.logprobs is not None
    assert legacy.logprobs.tokens == [lp.decoded_token for lp in sampled]
    assert legacy.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in sampled], abs=1e-4)
    # vLLM's legacy top_logprobs: the most likely token and the sampled one, by text.
    assert legacy.logprobs.top_logprobs == [
        pytest.approx({lp.decoded_token: lp.logprob for lp in e.values()}, abs=1e-4) for e in ref.logprobs
    ]


def test_completions(client: openai.OpenAI, offline: LLM) -> None:
    ref = offline.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    reply = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert reply.choices[0].text == ref.text
    ids = offline.get_tokenizer().encode("Once upon a time")
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == ref.text
    batch = client.completions.create(model="tiny", prompt=["Once upon a time", "The end"], max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == ref.text[
        : len(batch.choices[0].text)
    ]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == ref.text


def test_models_health_and_metrics(server: Server, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-qwen2-vl"]  # the checkpoint folder name by default
    assert server.health() == 200
    metrics = server.get("/metrics").text
    assert 'vlmserve_requests_total{outcome="success"}' in metrics
    for name in (
        "vlmserve_generation_tokens_total",
        "vlmserve_image_tokens_total",
        "vlmserve_num_requests_running",
        "vlmserve_kv_cache_usage_ratio",
        "vlmserve_prefix_cache_hits",
        "vlmserve_encoder_cache_hits",
    ):
        assert name in metrics


def test_n_samples_share_one_image(client: openai.OpenAI) -> None:
    messages = image_message(data_url(picture(9)), "Several answers, please.")
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, n=3, temperature=1.0, top_p=1.0, seed=3, extra_body={"top_k": 0}
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage is not None and reply.usage.completion_tokens <= 18
    assert len({c.message.content for c in reply.choices}) > 1
    assert segments_left() == []
