"""vLLM and OpenAI API parity (issue 17), against one real server behind `--root-path /proxy`:
every known field vlmserve does not implement is refused with a 400 naming it (each one sent
here); the fields it implements do what vLLM's do (return_token_ids, request_id, text_offset,
usage details, /v1/models' fields; prompt_logprobs and top_logprobs -1 against transformers' log-
softmax, echo, return_tokens_as_token_ids, allowed_token_ids); vLLM's extra endpoints answer in vLLM's shapes; /metrics
carries vLLM's series names, with vLLM's buckets, moving as requests run."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import Server, data_url, image_message, picture, start_server
from tests.conftest import write_video
from tests.reference import hf_logits
from vlmserve.api.protocol import UNSUPPORTED_FIELDS
from vlmserve.version import __version__

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
# vLLM's buckets, as vllm/v1/metrics/loggers.py writes them.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TTFT_BUCKETS += [20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
ITL_BUCKETS += [20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0]
LATENCY_BUCKETS += [480.0, 960.0, 1920.0, 7680.0]


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        tiny_dir, tmp_path_factory.mktemp("parity"), "--root-path", "/proxy", "--max-logprobs", "-1", "--disable-web-ui"
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def body_for(endpoint: str, **fields: object) -> dict[str, object]:
    base: dict[str, object] = {"messages": MESSAGES} if endpoint == CHAT else {"prompt": "Once upon a time"}
    return {**base, "model": "tiny", **GREEDY, **fields}


# Every field refused, with a value that asks for what is not implemented.
NOT_OFF = {
    "prompt_embeds": "AAAA",
    "logits_processors": ["x.y"],
    "cache_salt": "salt",
    "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"a": 1},
    "repetition_detection": {"max_pattern_size": 4},
    "priority": 1,
    "structural_tag": {"type": "structural_tag", "structures": [], "triggers": []},
    "guided_whitespace_pattern": " *",
    "guided_decoding_backend": "outlines",
    "documents": [{"title": "t", "text": "x"}],
}
REFUSED = [(endpoint, field, value) for endpoint in (CHAT, COMPLETIONS) for field, value in NOT_OFF.items()] + [
    (COMPLETIONS, "suffix", "the end"),
    (CHAT, "best_of", 3),
    (COMPLETIONS, "best_of", 2),
    (CHAT, "priority", False),  # a bool is not the number 0
]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_the_refused_list_covers_the_table() -> None:
    assert set(NOT_OFF) == set(UNSUPPORTED_FIELDS)


@pytest.mark.parametrize(("endpoint", "field", "value"), REFUSED)
def test_a_field_not_implemented_is_refused_by_name(server: Server, endpoint: str, field: str, value: object) -> None:
    reply = server.post(endpoint, body_for(endpoint, **{field: value}))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field
    assert field in error["message"]


@pytest.mark.parametrize(
    ("endpoint", "fields"),
    [
        (CHAT, {"use_beam_search": False, "priority": 0, "length_penalty": 1.0, "prompt_logprobs": None}),
        (CHAT, {"echo": False, "continue_final_message": False, "add_special_tokens": True, "best_of": 1}),
        (COMPLETIONS, {"echo": False, "suffix": None, "add_special_tokens": False, "mm_processor_kwargs": {}}),
        (CHAT, {"stream_options": None}),
        (COMPLETIONS, {"guided_decoding_backend": "xgrammar", "structural_tag": None}),
        (CHAT, {"stream_options": {}}),  # vLLM lets an empty one through without stream
        (CHAT, {"spaces_between_special_tokens": False}),
        (CHAT, {"tools": [], "tool_choice": "none"}),
    ],
)
def test_the_off_values_pass(server: Server, endpoint: str, fields: dict[str, object]) -> None:
    reply = server.post(endpoint, body_for(endpoint, **fields))
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        # This server's checkpoint (Qwen2-VL) has no template that takes tools.
        ({"tools": [TOOL], "tool_choice": "none"}, "tools", "does not take tools"),
        ({"tools": [TOOL], "tool_choice": "required"}, "tools", "does not take tools"),
        # "auto" (the default with tools) needs --enable-auto-tool-choice, as in vLLM.
        ({"tools": [TOOL]}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "'g'"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name", "Field required"),
        ({"tools": [TOOL, TOOL], "tool_choice": "none"}, "tools[1]", "a second function"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "reasoning_effort"),
    ],
)
def test_tool_fields_a_server_cannot_use_are_refused(
    server: Server, fields: dict[str, object], param: str, words: str
) -> None:
    reply = server.post(CHAT, body_for(CHAT, **fields))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], words in error["message"]) == (param, True), error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: vLLM's 400
        ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt: vLLM's 400
        ({"truncate_prompt_tokens": 4097}, "truncate_prompt_tokens"),  # over max_model_len
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncation_side": "middle"}, "truncation_side"),
        ({"media_io_kwargs": "invalid"}, "media_io_kwargs"),
        ({"media_io_kwargs": {"video": {"frames": 4}}}, "media_io_kwargs"),
        ({"mm_processor_kwargs": {"bogus": 1}}, "mm_processor_kwargs"),
        ({"mm_processor_kwargs": []}, "mm_processor_kwargs"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: vLLM's 400
    ],
)
def test_vllm_s_cross_field_rules(server: Server, fields: dict[str, object], param: str) -> None:
    reply = server.post(CHAT, body_for(CHAT, **fields))
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_the_openai_client_sees_a_refusal_as_a_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"vllm_xargs": {"a": 1}})  # type: ignore[arg-type]
    assert refused.value.body["param"] == "vllm_xargs"  # type: ignore[index]


def test_chat_beam_search_answers_n_distinct_beams_best_first(client: openai.OpenAI) -> None:
    """use_beam_search through the openai client: n beams, each its own text, ranked by vLLM's
    score (the sum of its tokens' logprobs over its length, the prompt counted: no eos in these
    few tokens of a random model, so all are equally long and the sums decide); the chosen
    tokens are the ones greedy search cannot all take (distinct beams)."""
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        n=3,
        max_tokens=3,
        temperature=0,
        logprobs=True,
        extra_body={"use_beam_search": True, "length_penalty": 1.0, "return_token_ids": True},
    )
    choices = reply.choices
    assert [c.index for c in choices] == [0, 1, 2]
    ids = [tuple(c.model_extra["token_ids"]) for c in choices]  # type: ignore[index]
    assert len(set(ids)) == 3 and all(len(i) == 3 for i in ids)
    cums = [sum(t.logprob for t in c.logprobs.content) for c in choices]  # type: ignore[union-attr]
    assert cums == sorted(cums, reverse=True)
    greedy = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True)  # type: ignore[arg-type]
    greedy_cum = sum(t.logprob for t in greedy.choices[0].logprobs.content)  # type: ignore[union-attr]
    assert cums[0] >= greedy_cum - 1e-4  # the best beam is at least as likely as greedy's answer


def test_an_unknown_field_is_ignored_with_a_warning(server: Server) -> None:
    reply = server.post(CHAT, body_for(CHAT, zz_unknown_field=1))
    assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + 30
    while "zz_unknown_field" not in server.log.read_text():
        assert time.monotonic() < deadline, "no warning naming the ignored field"
        time.sleep(0.1)
    assert "ignored" in server.log.read_text()


def _sse(reply: httpx.Response) -> list[dict]:
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_chat_return_token_ids_and_request_id(server: Server) -> None:
    whole = server.post(CHAT, body_for(CHAT, return_token_ids=True, request_id="abc")).json()
    tokenized = server.post("/tokenize", {"messages": MESSAGES}).json()
    assert whole["id"] == "chatcmpl-abc"
    assert whole["prompt_token_ids"] == tokenized["tokens"]
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
    ids = whole["choices"][0]["token_ids"]
    assert len(ids) == whole["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    # Streamed: the prompt's ids on the first chunk, the generated ones in deltas adding up.
    chunks = _sse(server.post(CHAT, body_for(CHAT, return_token_ids=True, stream=True)))
    assert chunks[0]["prompt_token_ids"] == tokenized["tokens"]
    assert [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids", [])] == ids
    # Not asked: not there.
    plain = server.post(CHAT, body_for(CHAT)).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_completions_token_ids_offsets_and_usage(server: Server) -> None:
    prompt = "Once upon a time"
    whole = server.post(COMPLETIONS, body_for(COMPLETIONS, return_token_ids=True, logprobs=1)).json()
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"]
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    logprobs = choice["logprobs"]
    # Each token starts where the previous one's text ends.
    expected, at = [], 0
    for token in logprobs["tokens"]:
        expected.append(at)
        at += len(token)
    assert logprobs["text_offset"] == expected and expected[-1] > 0
    # Streamed: each chunk's offsets go on from the text sent before it; the ids add up.
    chunks = _sse(server.post(COMPLETIONS, body_for(COMPLETIONS, return_token_ids=True, logprobs=1, stream=True)))
    offsets = [o for c in chunks for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    assert offsets == expected
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]


def test_models_carry_openai_s_and_vllm_s_fields(client: openai.OpenAI, tiny_dir: Path) -> None:
    (model,) = client.models.list().data
    assert model.id == "tiny" and model.object == "model" and model.owned_by == "vlmserve"
    assert isinstance(model.created, int) and abs(model.created - time.time()) < 3600
    extra = model.model_extra or {}
    assert extra["root"] == str(tiny_dir) and extra["max_model_len"] == 4096
    assert extra["permission"][0]["object"] == "model_permission"
    # vlmserve's own: what a client (the chat page) says the model is and can be asked.
    own = extra["vlmserve"]
    assert own["family"] == "Qwen2-VL" and own["grounding_convention"] == "qwen2-vl"
    assert own["about"] is None and "Describe this picture." in own["example_questions"]


def test_tokenize_a_chat_with_an_image_counts_its_placeholders(server: Server) -> None:
    messages = image_message(data_url(picture()))
    tokenized = server.post("/tokenize", {"messages": messages, "return_token_strs": True}).json()
    served = server.post(CHAT, {"messages": messages, "model": "tiny", "max_tokens": 1}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == served["usage"]["prompt_tokens"]
    assert tokenized["max_model_len"] == 4096
    image_tokens = served["usage"]["multimodal_tokens"][0]["tokens"]
    assert tokenized["token_strs"].count("<|image_pad|>") == image_tokens > 0
    without = server.post("/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < tokenized["count"]  # the assistant turn's opening is gone


def test_tokenize_and_detokenize_a_prompt_round_trip(server: Server) -> None:
    text = "Hello, world: <|im_start|> again"
    tokens = server.post("/tokenize", {"prompt": text, "add_special_tokens": True}).json()["tokens"]
    assert server.post("/detokenize", {"tokens": tokens}).json() == {"prompt": text}
    bad = server.post("/detokenize", {"tokens": [1, 10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    refused = server.post("/tokenize", {"messages": MESSAGES, "continue_final_message": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


def test_invocations_routes_by_shape(server: Server) -> None:
    chat = server.post("/invocations", body_for(CHAT))
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = server.post("/invocations", body_for(COMPLETIONS))
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    assert (
        chat.json()["choices"][0]["message"]["content"]
        == server.post(CHAT, body_for(CHAT)).json()["choices"][0]["message"]["content"]
    )
    neither = server.post("/invocations", {"input": "x"})
    assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]
    invalid = server.post("/invocations", body_for(CHAT, max_tokens=0))
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "max_tokens"


def test_version_ping_load_and_root_path(server: Server) -> None:
    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200
    assert server.get("/load").json() == {"server_load": 0}
    assert httpx.get(server.url + "/load").status_code == 401  # behind the key, like /v1
    assert {"url": "/proxy"} in server.get("/openapi.json").json()["servers"]


def _scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(server.url + "/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(scrape: dict, name: str, **labels: str) -> float:
    wanted = {"model_name": "tiny", "engine": "0", **labels}
    return sum(v for (n, ls), v in scrape.items() if n == name and wanted.items() <= dict(ls).items())


def _buckets(scrape: dict, name: str) -> list[float]:
    return sorted(float(dict(ls)["le"]) for (n, ls) in scrape if n == f"{name}_bucket" and dict(ls)["le"] != "+Inf")


def test_metrics_under_vllm_s_names_move_as_requests_run(server: Server) -> None:
    before = _scrape(server)
    assert _buckets(before, "vllm:time_to_first_token_seconds") == TTFT_BUCKETS
    assert _buckets(before, "vllm:inter_token_latency_seconds") == ITL_BUCKETS
    assert _buckets(before, "vllm:e2e_request_latency_seconds") == LATENCY_BUCKETS
    reply = server.post(CHAT, body_for(CHAT)).json()
    after = _scrape(server)
    usage = reply["usage"]
    delta = {
        name: _value(after, name, **labels) - _value(before, name, **labels)
        for name, labels in [
            ("vllm:prompt_tokens_total", {}),
            ("vllm:generation_tokens_total", {}),
            ("vllm:time_to_first_token_seconds_count", {}),
            ("vllm:inter_token_latency_seconds_count", {}),
            ("vllm:e2e_request_latency_seconds_count", {}),
            ("vllm:request_success_total", {"finished_reason": "length"}),
            ("vllm:request_prompt_tokens_sum", {}),
        ]
    }
    assert delta == {
        "vllm:prompt_tokens_total": usage["prompt_tokens"],
        "vllm:generation_tokens_total": usage["completion_tokens"],
        "vllm:time_to_first_token_seconds_count": 1,
        # One gap per step after the first token's (the engine may hand over a few at once).
        "vllm:inter_token_latency_seconds_count": delta["vllm:inter_token_latency_seconds_count"],
        "vllm:e2e_request_latency_seconds_count": 1,
        "vllm:request_success_total": 1,
        "vllm:request_prompt_tokens_sum": usage["prompt_tokens"],
    }
    assert 1 <= delta["vllm:inter_token_latency_seconds_count"] <= usage["completion_tokens"] - 1
    # The engine's gauges: a long request shows as running while it runs, and not after.
    stop = threading.Event()

    def long_request() -> None:
        body = body_for(CHAT, stream=True, max_tokens=3000)
        with httpx.stream("POST", server.url + CHAT, json=body, headers=server.headers, timeout=120) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    worker = threading.Thread(target=long_request)
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while _value(_scrape(server), "vllm:num_requests_running") != 1:
            assert time.monotonic() < deadline, "vllm:num_requests_running never showed the request"
            time.sleep(0.1)
    finally:
        stop.set()
        worker.join()
    deadline = time.monotonic() + 60
    while _value(_scrape(server), "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "vllm:num_requests_running stayed up after the request left"
        time.sleep(0.1)


def test_metrics_of_n_samples_per_sample_and_per_request_as_vllm(server: Server) -> None:
    before = _scrape(server)
    for name, buckets in [
        ("vllm:iteration_tokens_total", [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0]),
        ("vllm:request_params_n", [1.0, 2.0, 5.0, 10.0, 20.0]),
        ("vllm:request_queue_time_seconds", LATENCY_BUCKETS),
        ("vllm:request_prefill_time_seconds", LATENCY_BUCKETS),
        ("vllm:request_decode_time_seconds", LATENCY_BUCKETS),
        ("vllm:request_inference_time_seconds", LATENCY_BUCKETS),
        ("vllm:request_time_per_output_token_seconds", ITL_BUCKETS),
        ("vllm:request_params_max_tokens", [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]),
    ]:
        assert _buckets(before, name) == buckets + ([8192.0, 16384.0] if name == "vllm:iteration_tokens_total" else [])
    # The KV cache as the engine built it (vLLM's info series: labels, value 1, no model_name).
    (info,) = [dict(ls) for (n, ls) in before if n == "vllm:cache_config_info"]
    assert info["engine"] == "0" and info["block_size"] == "16" and int(info["num_gpu_blocks"]) > 0
    assert before[("vllm:cache_config_info", tuple(sorted(info.items())))] == 1
    reply = server.post(COMPLETIONS, body_for(COMPLETIONS, n=2, max_tokens=4)).json()
    prompt_tokens = reply["usage"]["prompt_tokens"]
    assert reply["usage"]["completion_tokens"] == 8
    after = _scrape(server)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    # Per sample, as vLLM: each has its prompt, its max_tokens, its phases and its success.
    assert delta("vllm:prompt_tokens_total") == 2 * prompt_tokens
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert (delta("vllm:request_params_max_tokens_count"), delta("vllm:request_params_max_tokens_sum")) == (2, 8)
    assert delta("vllm:request_queue_time_seconds_count") == 2
    prefill, decode = delta("vllm:request_prefill_time_seconds_sum"), delta("vllm:request_decode_time_seconds_sum")
    assert abs(prefill + decode - delta("vllm:request_inference_time_seconds_sum")) < 1e-6
    # Per request: n, and its longest sample.
    assert (delta("vllm:request_params_n_count"), delta("vllm:request_params_n_sum")) == (1, 2)
    assert delta("vllm:request_params_n_bucket", le="1.0") == 0 and delta("vllm:request_params_n_bucket", le="2.0") == 1
    assert delta("vllm:request_max_num_generation_tokens_sum") == 4
    # Per engine step: the samples run side by side, 4 steps; both prompts, then 2 tokens a step.
    assert delta("vllm:iteration_tokens_total_count") == 4
    assert delta("vllm:iteration_tokens_total_sum") == 2 * prompt_tokens + 8


# -- request prompt options (vLLM's semantics) ---------------------------------------------------


def test_truncation_keeps_the_requested_side(server: Server) -> None:
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    ids = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    for side, kept in (("left", ids[-5:]), ("right", ids[:5]), (None, ids[-5:])):
        fields = {"truncate_prompt_tokens": 5, "return_token_ids": True} | ({"truncation_side": side} if side else {})
        cut = server.post(COMPLETIONS, body_for(COMPLETIONS, prompt=prompt, **fields)).json()
        assert cut["choices"][0]["prompt_token_ids"] == kept and cut["usage"]["prompt_tokens"] == 5
        # The same answer as the prompt cut by the client.
        by_hand = server.post(COMPLETIONS, body_for(COMPLETIONS, prompt=kept)).json()
        assert cut["choices"][0]["text"] == by_hand["choices"][0]["text"]
    # -1 is max_model_len: this prompt is kept whole.
    whole = server.post(
        COMPLETIONS, body_for(COMPLETIONS, prompt=prompt, truncate_prompt_tokens=-1, return_token_ids=True)
    )
    assert whole.json()["choices"][0]["prompt_token_ids"] == ids
    # Chat: the rendered prompt's tail.
    full = server.post("/tokenize", {"messages": MESSAGES}).json()["tokens"]
    chat = server.post(CHAT, body_for(CHAT, truncate_prompt_tokens=7, return_token_ids=True)).json()
    assert chat["prompt_token_ids"] == full[-7:] and chat["usage"]["prompt_tokens"] == 7


def test_truncation_keeps_an_image_whole_or_refuses_to_cut_it(server: Server) -> None:
    messages = image_message(data_url(picture()), text="Describe it in a few words.")
    full = server.post("/tokenize", {"messages": messages, "return_token_strs": True}).json()
    strs = full["token_strs"]
    first_pad, last_pad = strs.index("<|image_pad|>"), len(strs) - 1 - strs[::-1].index("<|image_pad|>")
    whole = len(strs) - first_pad + 1  # from <|vision_start|> on
    kept = server.post(
        CHAT, {**body_for(CHAT, messages=messages), "truncate_prompt_tokens": whole, "return_token_ids": True}
    )
    assert kept.status_code == 200, kept.text
    assert kept.json()["prompt_token_ids"] == full["tokens"][-whole:]
    assert kept.json()["usage"]["multimodal_tokens"][0]["tokens"] == last_pad - first_pad + 1
    through = server.post(
        CHAT, {**body_for(CHAT, messages=messages), "truncate_prompt_tokens": len(strs) - last_pad + 2}
    )
    assert through.status_code == 400, through.text
    assert through.json()["error"]["param"] == "truncate_prompt_tokens"
    assert "cut through" in through.json()["error"]["message"]


def test_continue_final_message_leaves_the_assistant_turn_open(server: Server, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    fields = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    reply = server.post(CHAT, body_for(CHAT, **fields, return_token_ids=True)).json()
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    ids = reply["prompt_token_ids"]
    assert ids == hf_tokenizer.encode(expected)
    assert ids[-len(hf_tokenizer.encode("The colour is")) :] == hf_tokenizer.encode("The colour is")
    assert hf_tokenizer.convert_tokens_to_ids("<|im_end|>") not in ids[-4:]
    assert server.post("/tokenize", fields).json()["tokens"] == ids
    closed = server.post(CHAT, body_for(CHAT, messages=messages, add_generation_prompt=False, return_token_ids=True))
    assert closed.json()["prompt_token_ids"][: len(ids)] == ids and len(closed.json()["prompt_token_ids"]) > len(ids)


def test_custom_roles_are_passed_to_the_template(server: Server, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "narrator", "content": "It was night."}, {"role": "user", "content": "Go on."}]
    reply = server.post(CHAT, body_for(CHAT, messages=messages, return_token_ids=True))
    assert reply.status_code == 200, reply.text
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert reply.json()["prompt_token_ids"] == hf_tokenizer.encode(expected)
    assert "<|im_start|>narrator\n" in expected
    bad = server.post(CHAT, body_for(CHAT, messages=[{"role": ["user"], "content": "x"}]))
    assert bad.status_code == 400 and "role must be a string" in bad.json()["error"]["message"]


def _video_tokens(reply: httpx.Response) -> int:
    assert reply.status_code == 200, reply.text
    (item,) = reply.json()["usage"]["multimodal_tokens"]
    return item["tokens"]


def test_media_io_and_processor_kwargs_change_what_the_model_sees(server: Server) -> None:
    video = "data:video/mp4;base64," + base64.b64encode(write_video(96, fps=24, width=56, height=56)).decode()
    part = {"type": "video_url", "video_url": {"url": video}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What happens?"}]}]
    base = body_for(CHAT, messages=messages, max_tokens=1)
    default = _video_tokens(server.post(CHAT, base))  # 4 s at fps 2: 8 frames
    four = _video_tokens(server.post(CHAT, {**base, "media_io_kwargs": {"video": {"num_frames": 4}}}))
    assert four * 2 == default
    fps_one = _video_tokens(server.post(CHAT, {**base, "mm_processor_kwargs": {"fps": 1}}))
    assert fps_one == four  # 4 s at 1 frame per second
    # A part's own option wins over the request's.
    own = [{"role": "user", "content": [{**part, "nframes": 8}, {"type": "text", "text": "What happens?"}]}]
    assert (
        _video_tokens(server.post(CHAT, {**base, "messages": own, "media_io_kwargs": {"video": {"num_frames": 4}}}))
        == default
    )
    # Image sizing for the whole request.
    image = body_for(CHAT, messages=image_message(data_url(picture(size=(224, 224)))), max_tokens=1)
    large = _video_tokens(server.post(CHAT, image))
    small = _video_tokens(server.post(CHAT, {**image, "mm_processor_kwargs": {"max_pixels": 56 * 56}}))
    assert (large, small) == (64, 4)
    # /tokenize counts them the same way.
    tokenized = server.post(
        "/tokenize", {"messages": image["messages"], "mm_processor_kwargs": {"max_pixels": 56 * 56}}
    ).json()
    assert tokenized["tokens"].count(151655) == 4  # <|image_pad|>


def test_continuous_usage_stats_put_usage_on_every_chunk(server: Server) -> None:
    options = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    for endpoint in (CHAT, COMPLETIONS):
        chunks = _sse(server.post(endpoint, body_for(endpoint, **options)))
        assert all("usage" in c for c in chunks), endpoint
        prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
        done = [c["usage"]["completion_tokens"] for c in chunks]
        assert done == sorted(done) and done[-1] == GREEDY["max_tokens"]
        assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks)
        assert all(c["usage"]["total_tokens"] == prompt_tokens + n for c, n in zip(chunks, done, strict=True))
        with_text = [c for c in chunks if c["choices"]]
        assert len(with_text) >= GREEDY["max_tokens"] and with_text[-1]["usage"]["completion_tokens"] == done[-1]
    plain = _sse(server.post(CHAT, body_for(CHAT, stream=True, stream_options={"include_usage": True})))
    assert ["usage" in c for c in plain] == [False] * (len(plain) - 1) + [True]


def test_a_media_uuid_reuses_the_cached_item(server: Server) -> None:
    url = data_url(picture(seed=7))
    sent = [{"type": "image_url", "image_url": {"url": url}, "uuid": "pic-7"}, {"type": "text", "text": "What?"}]
    first = server.post(CHAT, body_for(CHAT, messages=[{"role": "user", "content": sent}], logprobs=True))
    assert first.status_code == 200, first.text
    for reference in (
        {"type": "image_url", "image_url": None, "uuid": "pic-7"},
        {"type": "image_url", "image_url": {"url": ""}, "uuid": "pic-7"},
    ):
        again = server.post(
            CHAT, body_for(CHAT, messages=[{"role": "user", "content": [reference, sent[1]]}], logprobs=True)
        )
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        assert again.json()["usage"]["multimodal_tokens"] == first.json()["usage"]["multimodal_tokens"]
        # The same pixels, the same content hash: the prefix cache serves every full block of the
        # prompt, the image's included (another image would share only the blocks before it).
        usage = again.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 16
    other = [{"type": "image_url", "image_url": {"url": data_url(picture(seed=8))}}, sent[1]]
    usage = server.post(CHAT, body_for(CHAT, messages=[{"role": "user", "content": other}])).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"] - 16
    unknown = server.post(
        CHAT,
        body_for(
            CHAT, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": None, "uuid": "nope-1"}]}]
        ),
    )
    assert unknown.status_code == 400 and "'nope-1'" in unknown.json()["error"]["message"]
    assert unknown.json()["error"]["param"] == "messages"


# -- prompt_logprobs, echo, top_logprobs -1, return_tokens_as_token_ids, allowed_token_ids -----
# (This server runs with --max-logprobs -1; the offline tests, tests/entrypoints/
# test_llm_prompt_logprobs.py, check prompt logprobs of prompts prefilled in several chunks.)

PROMPT = "Once upon a time, in a lighthouse by the sea, there lived"
LP = {"model": "tiny", "temperature": 0, "max_tokens": 3, "ignore_eos": True}


def ok(reply: httpx.Response) -> dict:  # type: ignore[type-arg]
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def refused(reply: httpx.Response, param: str) -> str:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


def check_prompt_logprobs(served: list, ids: list[int], ref: torch.Tensor, k: int) -> None:  # type: ignore[type-arg]
    """vLLM's JSON: None, then per token {id: {logprob, rank, decoded_token}} with the prompt's
    token and the k most likely; ref [len - 1, vocab] log-softmax."""
    assert len(served) == len(ids) and served[0] is None
    for i, entry in enumerate(served[1:]):
        row, token = ref[i], ids[i + 1]
        assert str(token) in entry and len(entry) in (k, k + 1)
        for tid, lp in entry.items():
            assert lp["logprob"] == pytest.approx(float(row[int(tid)]), abs=1e-4)
            assert 1 + int((row > row[int(tid)] + 1e-5).sum()) <= lp["rank"] <= int((row >= row[int(tid)] - 1e-5).sum())
        best = sorted((lp["logprob"] for lp in entry.values()), reverse=True)[:k]
        assert best == pytest.approx(row.topk(k).values.tolist(), abs=1e-4)


def log_softmax(hf_model, ids: list[int], vision: dict) -> torch.Tensor:  # type: ignore[no-untyped-def, type-arg]
    return torch.log_softmax(hf_logits(hf_model, ids, vision).double(), dim=-1)[:-1]


def test_prompt_logprobs_in_completions_and_in_chat_with_an_image_equal_transformers(  # type: ignore[no-untyped-def]
    server: Server, hf_model, hf_image_processor
) -> None:
    body = ok(server.post(COMPLETIONS, {**LP, "prompt": PROMPT, "prompt_logprobs": 2, "return_token_ids": True}))
    choice = body["choices"][0]
    ids = choice["prompt_token_ids"]
    check_prompt_logprobs(choice["prompt_logprobs"], ids, log_softmax(hf_model, ids, {}), 2)

    image = picture(5)
    chat = {**LP, "messages": image_message(data_url(image)), "prompt_logprobs": 1, "return_token_ids": True}
    body = ok(server.post(CHAT, chat))
    ids = body["prompt_token_ids"]
    vision = dict(hf_image_processor([image], return_tensors="pt"))
    check_prompt_logprobs(body["prompt_logprobs"], ids, log_softmax(hf_model, ids, vision), 1)
    # The same prompt again: its blocks are cached now, prompt logprobs are computed all the same.
    again = ok(server.post(CHAT, chat))
    assert again["prompt_logprobs"] == body["prompt_logprobs"]


def test_prompt_logprobs_rules(server: Server) -> None:
    stream = {**LP, "prompt": PROMPT, "stream": True}
    assert "stream=True" in refused(server.post(COMPLETIONS, {**stream, "prompt_logprobs": 1}), "prompt_logprobs")
    assert "-1" in refused(server.post(COMPLETIONS, {**LP, "prompt": PROMPT, "prompt_logprobs": -2}), "prompt_logprobs")
    # Past the vocabulary even with --max-logprobs -1.
    too_many = {**LP, "prompt": PROMPT, "prompt_logprobs": 10**6}
    assert "more than" in refused(server.post(COMPLETIONS, too_many), "prompt_logprobs")


def test_completions_echo_puts_the_prompt_s_text_tokens_and_logprobs_first(
    server: Server, client: openai.OpenAI
) -> None:
    plain = ok(server.post(COMPLETIONS, {**LP, "prompt": PROMPT, "logprobs": 1, "prompt_logprobs": 1}))["choices"][0]
    echoed = ok(server.post(COMPLETIONS, {**LP, "prompt": PROMPT, "logprobs": 1, "echo": True}))["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    n = len(plain["prompt_logprobs"])
    lp, generated = echoed["logprobs"], plain["logprobs"]
    assert len(lp["tokens"]) == n + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # The prompt's tokens, scored given what precedes them (the prompt logprobs), then the answer.
    assert lp["token_logprobs"][1:n] == [
        entry[str(token)]["logprob"]
        for entry, token in zip(plain["prompt_logprobs"][1:], prompt_ids(server), strict=True)
    ]
    assert lp["tokens"][n:] == generated["tokens"] and lp["token_logprobs"][n:] == generated["token_logprobs"]
    assert "".join(lp["tokens"][:n]) == PROMPT
    # text_offset runs on through the prompt into the answer.
    lengths = [len(t) for t in lp["tokens"]]
    assert lp["text_offset"] == [sum(lengths[:i]) for i in range(n + 3)]
    assert lp["text_offset"][n] == len(PROMPT)

    # Streamed: the prompt comes on the first chunk, with its tokens first in that chunk's logprobs.
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            logprobs=1,
            echo=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed["text"]
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT) and first.logprobs is not None
    assert first.logprobs.token_logprobs[0] is None and first.logprobs.tokens[:n] == lp["tokens"][:n]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp["text_offset"]

    # Without logprobs: only the text.
    bare = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert bare.choices[0].text == echoed["text"] and bare.choices[0].logprobs is None


def prompt_ids(server: Server) -> list[int]:
    body = ok(server.post(COMPLETIONS, {**LP, "prompt": PROMPT, "return_token_ids": True, "max_tokens": 1}))
    return body["choices"][0]["prompt_token_ids"][1:]  # type: ignore[no-any-return]


def test_chat_echo_prepends_the_last_message_when_its_role_is_the_answer_s(
    server: Server, client: openai.OpenAI
) -> None:
    user = [{"role": "user", "content": "Say something."}]
    prefill = [*user, {"role": "assistant", "content": "Well, I think"}]

    def content(messages: list[dict], **fields: object) -> str:  # type: ignore[type-arg]
        return ok(server.post(CHAT, {**LP, "messages": messages, **fields}))["choices"][0]["message"]["content"]  # type: ignore[no-any-return]

    # The answer's role is the assistant's: a last user message is not echoed...
    assert content(user, echo=True) == content(user)
    # ...a last assistant message is, before the answer.
    assert content(prefill, echo=True) == "Well, I think" + content(prefill)
    # Without a generation prompt the answer continues the last message's role: always echoed.
    assert content(user, echo=True, add_generation_prompt=False) == "Say something." + content(
        user, add_generation_prompt=False
    )
    # Streamed: the echo comes first, in a chunk of its own.
    stream = client.chat.completions.create(
        model="tiny",
        messages=prefill,
        max_tokens=3,
        temperature=0,
        stream=True,
        extra_body={"echo": True, "ignore_eos": True},  # type: ignore[arg-type]
    )
    deltas = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert deltas[0] == "Well, I think" and "".join(deltas) == content(prefill, echo=True)


def test_top_logprobs_minus_one_is_the_whole_vocabulary_within_max_logprobs(server: Server, hf_model) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "Hi"}]
    body = ok(
        server.post(
            CHAT,
            {
                **LP,
                "max_tokens": 1,
                "messages": messages,
                "logprobs": True,
                "top_logprobs": -1,
                "return_token_ids": True,
            },
        )
    )
    top = body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    vocab = (
        hf_model.config.text_config.vocab_size
        if hasattr(hf_model.config, "text_config")
        else hf_model.config.vocab_size
    )
    assert len(top) == vocab
    ref = torch.log_softmax(hf_logits(hf_model, body["prompt_token_ids"], {})[-1].double(), dim=-1)
    served = sorted((t["logprob"] for t in top), reverse=True)
    assert served == pytest.approx(ref.sort(descending=True).values.tolist(), abs=1e-4)
    # More than the vocabulary: vLLM's 400 (the bound is max_logprobs, here the vocabulary).
    over = {**LP, "messages": messages, "logprobs": True, "top_logprobs": vocab + 1}
    assert str(vocab) in refused(server.post(CHAT, over), "top_logprobs")
    assert refused(server.post(CHAT, {**LP, "messages": messages, "top_logprobs": -1}), "top_logprobs")
    assert refused(
        server.post(CHAT, {**LP, "messages": messages, "logprobs": True, "top_logprobs": -2}), "top_logprobs"
    )


def test_return_tokens_as_token_ids(server: Server) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    fields = {"logprobs": True, "top_logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = ok(server.post(CHAT, {**LP, "messages": messages, **fields}))["choices"][0]
    content = choice["logprobs"]["content"]
    assert [t["token"] for t in content] == [f"token:{i}" for i in choice["token_ids"]]
    assert all(t["bytes"] == list(t["token"].encode()) for t in content)
    assert all(a["token"].startswith("token:") and int(a["token"][6:]) >= 0 for t in content for a in t["top_logprobs"])
    legacy = {"prompt": PROMPT, "logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = ok(server.post(COMPLETIONS, {**LP, **legacy}))["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token:{i}" for i in choice["token_ids"]]
    assert all(key.startswith("token:") for top in choice["logprobs"]["top_logprobs"] for key in top)
    # Off: the tokens' text.
    plain = ok(server.post(COMPLETIONS, {**LP, **legacy, "return_tokens_as_token_ids": False}))["choices"][0]
    assert not any(t.startswith("token:") for t in plain["logprobs"]["tokens"])


def test_allowed_token_ids_mask_every_other_token(server: Server, hf_model) -> None:  # type: ignore[no-untyped-def]
    body = ok(server.post(COMPLETIONS, {**LP, "prompt": PROMPT, "return_token_ids": True, "max_tokens": 1}))
    ids = body["choices"][0]["prompt_token_ids"]
    order = hf_logits(hf_model, ids, {})[-1].argsort(descending=True).tolist()
    allowed = [order[3000], order[50]]
    choice = ok(
        server.post(COMPLETIONS, {**LP, "prompt": PROMPT, "allowed_token_ids": allowed, "return_token_ids": True})
    )["choices"][0]
    assert choice["token_ids"][0] == order[50] and set(choice["token_ids"]) <= set(allowed)
    sampled = ok(
        server.post(
            CHAT,
            {
                **LP,
                "temperature": 1.0,
                "seed": 3,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "Hi"}],
                "allowed_token_ids": allowed,
                "return_token_ids": True,
            },
        )
    )["choices"][0]
    assert set(sampled["token_ids"]) <= set(allowed)
    assert "vocabulary" in refused(
        server.post(COMPLETIONS, {**LP, "prompt": PROMPT, "allowed_token_ids": [1, 10**7]}), "allowed_token_ids"
    )
    refused(server.post(COMPLETIONS, {**LP, "prompt": PROMPT, "allowed_token_ids": []}), "allowed_token_ids")
    json.dumps(sampled)  # the answer is plain JSON


def test_no_chat_page_with_disable_web_ui(server: Server) -> None:
    """vLLM serves nothing at /: nor does vlmserve with --disable-web-ui, and / is then no open path."""
    for path in ("/", "/web/app.js"):
        assert httpx.get(server.url + path, timeout=30).status_code == 401, path
        assert server.get(path).status_code == 404, path
