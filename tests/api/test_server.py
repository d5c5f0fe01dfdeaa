"""The real server on loopback, driven by the official openai client and by raw HTTP; answers
compared with the offline engine on the same checkpoint."""

from __future__ import annotations

import dataclasses
import time

import httpx
import openai
import pytest

from tests.api.conftest import Server, data_url, image_message, picture, segments_left
from tests.entrypoints.test_llm import PAD, chat_prompt
from tests.reference import IMAGE_TOKEN_ID, hf_prompt_ids
from vlmserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_llm: LLM) -> LLM:
    return tiny_llm  # the session's (tests/conftest.py)


def metric_values(server: Server) -> dict[str, float]:
    """Every sample of /metrics by its name and labels, e.g. 'vlmserve_requests_total{outcome="success"}';
    the engine's vlmserve_* series by name alone (their one label is engine="0", the only engine)."""
    values = {}
    for line in server.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.removesuffix('{engine="0"}')] = float(value)
    return values


def engine_metrics_now(server: Server, timeout: float = 30) -> dict[str, float]:
    """/metrics once its engine numbers include everything the engine did for the requests
    answered before this call, and the engine is idle.

    The engine reports its numbers every 0.5 s on the socket its outputs come by, in order, so a
    report that reaches the API process after an answer was sent after that answer. A one-token
    prompt (no image: the encoder counters do not move) makes the engine's prefix-cache queries
    grow; a snapshot in which they have grown past their value at the start of this call is such
    a later report."""
    start = metric_values(server)["vlmserve_prefix_cache_queries"]
    probe = server.post("/v1/completions", {"prompt": [785], "max_tokens": 1})
    assert probe.status_code == 200, probe.text
    deadline = time.monotonic() + timeout
    while True:
        values = metric_values(server)
        if (
            values["vlmserve_prefix_cache_queries"] > start
            and values["vlmserve_num_requests_running"] == 0
            and values["vlmserve_num_requests_waiting"] == 0
        ):
            return values
        assert time.monotonic() < deadline, f"the engine reported no idle state within {timeout} s: {values}"
        time.sleep(0.05)


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
    sampling = {"temperature": 0.7, "top_p": 1.0, "seed": 9, "max_tokens": 6}
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


def test_completions_by_text_ids_batch_and_stream_equal_the_offline_engine(client: openai.OpenAI, offline: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8)
    ref = offline.generate("Once upon a time", greedy)[0].outputs[0]
    reply = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert reply.choices[0].text == ref.text
    ids = offline.get_tokenizer().encode("Once upon a time")
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == ref.text
    # A batch: each prompt's completion is its own offline answer, in the prompts' order.
    prompts = ["Once upon a time", "The end", "A cat sat"]
    expected = [out.outputs[0] for out in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=4))]
    assert len({out.text for out in expected}) == 3 and all(out.text for out in expected)  # the answers differ
    batch = client.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [out.text for out in expected]
    assert batch.usage is not None and batch.usage.completion_tokens == sum(len(out.token_ids) for out in expected)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == ref.text


def test_models_and_health(server: Server, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]  # --served-model-name (test_model_names.py: the default)
    assert server.health() == 200


def test_metrics_move_by_what_known_requests_used(  # type: ignore[no-untyped-def]
    server: Server, client: openai.OpenAI, hf_tokenizer, hf_image_processor
) -> None:
    image = picture(21)  # in no other request to this server: not in its encoder cache
    question = "Count me."
    messages = image_message(data_url(image), question)
    # The prompt as transformers builds it: 120 x 80 is resized to 112 x 84, 8 x 6 patches, 12 tokens.
    ids, vision = hf_prompt_ids(hf_tokenizer, hf_image_processor, chat_prompt(PAD + question), [image])
    assert vision["image_grid_thw"].tolist() == [[1, 6, 8]]
    before = engine_metrics_now(server)
    for _ in range(2):  # the second time, the prompt's full blocks come from the prefix cache
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 5
    api = metric_values(server)  # the API process counts as it answers: no wait needed
    after = engine_metrics_now(server)

    def moved(values: dict[str, float], name: str) -> float:
        return values.get(name, 0.0) - before.get(name, 0.0)

    assert moved(api, 'vlmserve_requests_total{outcome="success"}') == 2
    for outcome in ("aborted", "error", "engine_down"):
        assert moved(api, f'vlmserve_requests_total{{outcome="{outcome}"}}') == 0
    assert moved(api, "vlmserve_prompt_tokens_total") == 2 * len(ids)
    assert moved(api, "vlmserve_image_tokens_total") == 2 * 12
    assert moved(api, "vlmserve_generation_tokens_total") == 2 * 5
    assert moved(api, "vlmserve_requests_in_flight") == 0
    # The engine encoded the image once. The first block already holds some of its placeholders
    # (so nothing earlier shares it); the second request finds its full blocks, image and all, in
    # the prefix cache and computes only the tokens after them: no encoder output needed again.
    block = 16
    offset, cached = ids.index(IMAGE_TOKEN_ID), (len(ids) - 1) // block * block
    assert offset < block and offset + 12 <= cached
    assert moved(after, "vlmserve_encoder_cache_misses") == 1
    assert moved(after, "vlmserve_prefix_cache_hits") == cached
    assert moved(after, "vlmserve_encoder_cache_hits") == 0
    assert after["vlmserve_kv_cache_usage_ratio"] == 0
    assert after["vlmserve_preemptions"] == before["vlmserve_preemptions"]


def test_a_client_leaving_mid_stream_counts_as_aborted_not_as_success(server: Server) -> None:
    before = metric_values(server)
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers) as response,
    ):
        assert response.status_code == 200
        for i, _ in enumerate(response.iter_lines()):
            if i >= 4:
                break  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while True:
        values = metric_values(server)
        if values["vlmserve_requests_in_flight"] == 0:
            break
        assert time.monotonic() < deadline, "the request is still in flight 30 s after its client left"
        time.sleep(0.05)

    def moved(name: str) -> float:
        return values.get(name, 0.0) - before.get(name, 0.0)

    assert moved('vlmserve_requests_total{outcome="aborted"}') == 1
    assert moved('vlmserve_requests_total{outcome="success"}') == 0
    assert moved("vlmserve_generation_tokens_total") == 0  # counted for finished requests only
    assert moved("vlmserve_prompt_tokens_total") == 0


def test_n_samples_encode_the_image_once_and_sample_i_is_the_offline_run_with_seed_plus_i(
    server: Server, client: openai.OpenAI, offline: LLM
) -> None:
    messages = image_message(data_url(picture(9)), "Several answers, please.")  # in no other request
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 6}
    before = engine_metrics_now(server)
    reply = client.chat.completions.create(
        model="tiny", messages=messages, n=3, seed=3, logprobs=True, top_logprobs=0, extra_body={"top_k": 0}, **sampling
    )
    after = engine_metrics_now(server)
    # The three samples are admitted together: the first encodes the image, the others find it cached.
    assert after["vlmserve_encoder_cache_misses"] - before["vlmserve_encoder_cache_misses"] == 1
    assert after["vlmserve_encoder_cache_hits"] - before["vlmserve_encoder_cache_hits"] == 2
    assert [c.index for c in reply.choices] == [0, 1, 2]
    tokenizer = offline.get_tokenizer()
    for i, choice in enumerate(reply.choices):
        single = offline.chat(messages, SamplingParams(top_k=0, seed=3 + i, **sampling))[0].outputs[0]
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert [bytes(t.bytes) for t in choice.logprobs.content] == [tokenizer.token_bytes(t) for t in single.token_ids]
        assert choice.message.content == single.text
    assert len({c.message.content for c in reply.choices}) == 3
    assert segments_left() == []
