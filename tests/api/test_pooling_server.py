"""Pooling models served: /v1/embeddings (OpenAI's client, vLLM's chat form), /rerank (and its /v1
and /v2 aliases), /score and /pooling on a tiny Qwen3-VL-Embedding and a tiny Qwen3-VL-Reranker,
each answer equal to the offline LLM's on the same checkpoint; the refusals of the wrong kind of
request, in vLLM's words, and of bad input, with a good request after them."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch

from tests.api.conftest import API_KEY, Server, data_url, picture, start_server
from vlmserve import LLM
from vlmserve.api.retrieval import EMBEDDING_MAX_PIXELS as MAX_PIXELS
from vlmserve.api.retrieval import MIN_PIXELS

RERANKER_OVERRIDES = {
    "architectures": ["Qwen3VLForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
# The servers' limits (the session's embedding_server has the same, tests/conftest.py).
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 512
FLAGS = ("--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(MAX_MODEL_LEN))
TEXTS = ["a photo of a cat", "the weather today", "x"]


@pytest.fixture(scope="module")
def reranker_server(reranker_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    overrides = ("--runner", "pooling", "--hf-overrides", json.dumps(RERANKER_OVERRIDES))
    s = start_server(reranker_dir, tmp_path_factory.mktemp("reranker-server"), *FLAGS, *overrides)
    yield s
    s.stop()


def _offline(model_dir: Path, **kwargs: Any) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory_gib=0.05, **kwargs)


@pytest.fixture(scope="module")
def embedder(embedding_dir: Path) -> LLM:
    return _offline(embedding_dir)


@pytest.fixture(scope="module")
def reranker(reranker_dir: Path) -> LLM:
    return _offline(reranker_dir, runner="pooling", hf_overrides=RERANKER_OVERRIDES)


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY)


def _vectors(answer: dict[str, Any]) -> list[list[float]]:
    assert [d["index"] for d in answer["data"]] == list(range(len(answer["data"])))
    return [d["embedding"] for d in answer["data"]]


def _error(response: Any, status: int = 400) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return str(body["error"]["message"])


IMAGE_URL = data_url(picture(3, (128, 96)))
CONVERSATION = [
    {"role": "system", "content": [{"type": "text", "text": "Represent the user's input."}]},
    {
        "role": "user",
        "content": [
            # sized as Qwen3-VL-Embedding's script sizes an image (retrieval.py)
            {"type": "image_url", "image_url": {"url": IMAGE_URL}, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS},
            {"type": "text", "text": "a picture"},
        ],
    },
]
IMAGE_DOCUMENT = {"content": [{"type": "image_url", "image_url": {"url": IMAGE_URL}}]}


# -- embeddings ---------------------------------------------------------------------------------


def test_openai_client_embeddings_equal_the_offline_llm_in_float_and_base64(
    embedding_server: Server, embedder: LLM
) -> None:
    client = _client(embedding_server)
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == "tiny"
    assert [d.index for d in floats.data] == [0, 1, 2] and all(d.object == "embedding" for d in floats.data)
    offline = embedder.embed(TEXTS)
    for served, alone in zip(floats.data, offline, strict=True):
        assert len(served.embedding) == 64
        np.testing.assert_allclose(served.embedding, alone.outputs.embedding, atol=1e-5)
        assert np.linalg.norm(served.embedding) == pytest.approx(1.0, abs=1e-5)
    # The client asks for base64 unless told otherwise, and decodes it itself.
    decoded = client.embeddings.create(model="tiny", input=TEXTS)
    for a, b in zip(decoded.data, floats.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-5)
    raw = embedding_server.post("/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"}).json()
    little_endian = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(little_endian, floats.data[0].embedding, atol=1e-5)
    # usage: the prompts' tokens, as the tokenizer counts them (nothing generated)
    counts = [embedding_server.post("/tokenize", {"prompt": t}).json()["count"] for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(counts)
    assert [len(o.prompt_token_ids) for o in offline] == counts


def test_token_ids_are_embedded_as_the_text_they_spell(embedding_server: Server) -> None:
    ids = embedding_server.post("/tokenize", {"prompt": TEXTS[0]}).json()["tokens"]
    by_text = _vectors(embedding_server.post("/v1/embeddings", {"input": TEXTS[0]}).json())[0]
    by_ids = _vectors(embedding_server.post("/v1/embeddings", {"input": [ids, ids[:2]]}).json())
    np.testing.assert_allclose(by_ids[0], by_text, atol=1e-5)
    assert not np.allclose(by_ids[1], by_text, atol=1e-3)


def test_dimensions_keep_the_first_values_normalised_again(embedding_server: Server) -> None:
    client = _client(embedding_server)
    full = np.array(client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float").data[0].embedding)
    short = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float", dimensions=16)
    assert len(short.data[0].embedding) == 16
    np.testing.assert_allclose(short.data[0].embedding, full[:16] / np.linalg.norm(full[:16]), atol=1e-5)
    # normalize false (vLLM's): the pooled hidden state as it is, in the same direction
    raw = _vectors(embedding_server.post("/v1/embeddings", {"input": TEXTS[0], "normalize": False}).json())[0]
    assert np.linalg.norm(raw) > 4  # the final RMSNorm's output: about sqrt(64) = 8 long
    np.testing.assert_allclose(np.array(raw) / np.linalg.norm(raw), full, atol=1e-5)


def test_messages_with_an_image_equal_the_offline_embedding_of_the_conversation(
    embedding_server: Server, embedder: LLM
) -> None:
    answer = embedding_server.post("/v1/embeddings", {"model": "tiny", "messages": CONVERSATION}).json()
    served = _vectors(answer)[0]
    offline = embedder.embed(CONVERSATION)[0]
    np.testing.assert_allclose(served, offline.outputs.embedding, atol=1e-5)
    # The official object's conversation is this one: the same embedding.
    official = embedder.embed({"image": IMAGE_URL, "text": "a picture"})[0]
    np.testing.assert_allclose(served, official.outputs.embedding, atol=1e-5)
    assert answer["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
    text_only = _vectors(embedding_server.post("/v1/embeddings", {"input": "a picture"}).json())[0]
    assert not np.allclose(served, text_only, atol=1e-3)


def test_pooling_returns_the_raw_vectors(embedding_server: Server) -> None:
    pooled = embedding_server.post("/pooling", {"input": TEXTS[:2]}).json()
    embedded = _vectors(embedding_server.post("/v1/embeddings", {"input": TEXTS[:2]}).json())
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    np.testing.assert_allclose([d["data"] for d in pooled["data"]], embedded, atol=1e-5)


# -- rerank and score ---------------------------------------------------------------------------

QUERY = "a cat on a sofa"
DOCUMENTS: list[Any] = ["a cat sleeping on a couch", "stock prices fell", IMAGE_DOCUMENT, "cats"]


def test_rerank_scores_equal_the_offline_llm_best_first(reranker_server: Server, reranker: LLM) -> None:
    offline = [o.outputs.score for o in reranker.score(QUERY, DOCUMENTS)]
    answer = reranker_server.post("/rerank", {"model": "tiny", "query": QUERY, "documents": DOCUMENTS}).json()
    assert answer["model"] == "tiny" and answer["id"].startswith("rerank-")
    results = answer["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    for r in results:
        assert r["relevance_score"] == pytest.approx(offline[r["index"]], abs=1e-5)
    assert [r["index"] for r in results] == sorted(range(4), key=lambda i: -offline[i])
    assert results[0]["document"] == {"text": DOCUMENTS[results[0]["index"]]} or results[0]["index"] == 2
    by_index = {r["index"]: r["document"] for r in results}
    assert by_index[1] == {"text": "stock prices fell"}
    assert by_index[2] == {"multi_modal": IMAGE_DOCUMENT["content"][0]}
    tokens = sum(len(o.prompt_token_ids) for o in reranker.score(QUERY, DOCUMENTS))
    assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_rerank_top_n_the_aliases_and_vllms_multimodal_documents(reranker_server: Server, reranker: LLM) -> None:
    offline = [o.outputs.score for o in reranker.score(QUERY, DOCUMENTS)]
    best = sorted(range(4), key=lambda i: -offline[i])[:2]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        answer = reranker_server.post(path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}).json()
        assert [r["index"] for r in answer["results"]] == best
    plain = reranker_server.post("/rerank", {"query": QUERY, "documents": DOCUMENTS, "return_documents": False})
    assert all("document" not in r for r in plain.json()["results"])
    # vLLM's {"content": [parts]}: each part one document.
    parts = {"content": [{"type": "text", "text": "stock prices fell"}, IMAGE_DOCUMENT["content"][0]]}
    answer = reranker_server.post("/rerank", {"query": QUERY, "documents": parts}).json()
    scores = {r["index"]: r["relevance_score"] for r in answer["results"]}
    assert scores[1] == pytest.approx(offline[2], abs=1e-5)
    assert scores[0] == pytest.approx(offline[1], abs=1e-5)  # a text part is the text


def test_a_rerank_instruction_is_the_rerankers_task(reranker_server: Server, reranker: LLM) -> None:
    instruction = "Find the documents about animals."
    offline = [o.outputs.score for o in reranker.score(QUERY, DOCUMENTS[:2], instruction=instruction)]
    answer = reranker_server.post("/rerank", {"query": QUERY, "documents": DOCUMENTS[:2], "instruction": instruction})
    scores = {r["index"]: r["relevance_score"] for r in answer.json()["results"]}
    assert [scores[0], scores[1]] == pytest.approx(offline, abs=1e-5)


def test_score_pairs_as_vllm(reranker_server: Server, reranker: LLM) -> None:
    offline = [o.outputs.score for o in reranker.score(QUERY, DOCUMENTS[:2])]
    for path in ("/score", "/v1/score"):
        answer = reranker_server.post(path, {"model": "tiny", "text_1": QUERY, "text_2": DOCUMENTS[:2]}).json()
        assert answer["object"] == "list" and [d["object"] for d in answer["data"]] == ["score", "score"]
        assert [d["score"] for d in answer["data"]] == pytest.approx(offline, abs=1e-5)
    pairwise = reranker_server.post("/score", {"text_1": [QUERY, "dogs"], "text_2": DOCUMENTS[:2]}).json()
    second = reranker.score("dogs", DOCUMENTS[1])[0].outputs.score
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([offline[0], second], abs=1e-5)


def test_an_embedding_models_scores_are_cosine_similarities(embedding_server: Server, embedder: LLM) -> None:
    offline = [o.outputs.score for o in embedder.score(QUERY, DOCUMENTS)]
    answer = embedding_server.post("/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()
    scores = {r["index"]: r["relevance_score"] for r in answer["results"]}
    assert [scores[i] for i in range(4)] == pytest.approx(offline, abs=1e-5)
    vectors = _vectors(embedding_server.post("/v1/embeddings", {"input": [QUERY, DOCUMENTS[0]]}).json())
    assert scores[0] == pytest.approx(float(np.dot(vectors[0], vectors[1])), abs=1e-5)
    score = embedding_server.post("/score", {"text_1": QUERY, "text_2": DOCUMENTS[0]}).json()
    assert score["data"][0]["score"] == pytest.approx(offline[0], abs=1e-5)


# -- refusals -----------------------------------------------------------------------------------


def test_generation_endpoints_refuse_a_pooling_model_in_vllms_words(embedding_server: Server) -> None:
    message = [{"role": "user", "content": "hi"}]
    for path, body, api in (
        ("/v1/chat/completions", {"messages": message}, "Chat Completions"),
        ("/v1/completions", {"prompt": "hi"}, "Completions"),
        ("/v1/responses", {"input": "hi"}, "Responses"),
    ):
        text = _error(embedding_server.post(path, body))
        assert text.startswith(f"The model does not support {api} API")
        assert "--runner generate" in text


def test_pooling_endpoints_refuse_a_generation_model_in_vllms_words(qwen3_server: Server) -> None:
    for path, body, api in (
        ("/v1/embeddings", {"input": "hi"}, "Embeddings"),
        ("/pooling", {"input": "hi"}, "Pooling"),
        ("/rerank", {"query": "q", "documents": ["d"]}, "Rerank (Score)"),
        ("/score", {"text_1": "q", "text_2": "d"}, "Score"),
    ):
        text = _error(qwen3_server.post(path, body))
        assert text.startswith(f"The model does not support {api} API")
        assert "--runner pooling" in text


def test_a_reranker_refuses_embeddings(reranker_server: Server) -> None:
    text = _error(reranker_server.post("/v1/embeddings", {"input": "hi"}))
    assert text.startswith("The model does not support Embeddings API") and "'score'" in text


def test_bad_pooling_requests_are_400s_naming_the_problem_and_the_server_goes_on(
    embedding_server: Server, reranker_server: Server
) -> None:
    before = _vectors(embedding_server.post("/v1/embeddings", {"input": TEXTS[0]}).json())[0]
    assert "input is an empty list" in _error(embedding_server.post("/v1/embeddings", {"input": []}))
    assert "input is empty" in _error(embedding_server.post("/v1/embeddings", {"input": ""}))
    assert "documents is empty" in _error(reranker_server.post("/rerank", {"query": "q", "documents": []}))
    assert "text_2 is empty" in _error(reranker_server.post("/score", {"text_1": "q", "text_2": []}))
    too_many = _error(embedding_server.post("/v1/embeddings", {"input": ["a"] * (MAX_NUM_SEQS + 1)}))
    assert f"{MAX_NUM_SEQS + 1} prompts" in too_many and f"the {MAX_NUM_SEQS} sequences" in too_many
    assert "--max-num-seqs" in too_many and "split the request" in too_many
    documents = ["d"] * (MAX_NUM_SEQS + 1)
    assert "split the request" in _error(reranker_server.post("/rerank", {"query": "q", "documents": documents}))
    wide = _error(embedding_server.post("/v1/embeddings", {"input": "a", "dimensions": 65}))
    assert "dimensions must be between 1 and the model's embedding size 64, got 65" in wide
    broken = {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    response = reranker_server.post("/rerank", {"query": "q", "documents": ["d", broken]})
    undecodable = _error(response)
    assert undecodable.startswith("query, documents[1]: ") and "image" in undecodable
    assert response.json()["error"]["param"] == "documents[1]"
    long = _error(embedding_server.post("/v1/embeddings", {"input": [[9707] * (MAX_MODEL_LEN + 10)]}))
    assert f"max_model_len={MAX_MODEL_LEN}" in long and str(MAX_MODEL_LEN + 10) in long
    mismatched = _error(reranker_server.post("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}))
    assert "text_1 has 2 items and text_2 3" in mismatched
    after = _vectors(embedding_server.post("/v1/embeddings", {"input": TEXTS[0]}).json())[0]
    np.testing.assert_allclose(after, before, atol=1e-5)
    assert reranker_server.post("/rerank", {"query": "q", "documents": ["d"]}).status_code == 200


def test_models_lists_the_pooling_model(embedding_server: Server) -> None:
    assert [m["id"] for m in embedding_server.get("/v1/models").json()["data"]] == ["tiny"]


def test_a_wrong_hf_overrides_stops_the_server_at_start_naming_it(embedding_dir: Path) -> None:
    command = [sys.executable, "-m", "vlmserve.entrypoints.cli", "serve", str(embedding_dir), "--hf-overrides", "[1]"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--hf-overrides" in done.stderr and "expected a JSON object" in done.stderr


def test_pooled_vectors_cross_the_engine_socket_as_float32() -> None:
    from vlmserve.ipc.contracts import EngineCoreOutput
    from vlmserve.ipc.messages import AddRequest, StepOutputs, encoder, from_engine_decoder, to_engine_decoder
    from vlmserve.multimodal.inputs import ProcessedPrompt
    from vlmserve.pooling import PoolingParams
    from vlmserve.sampling_params import SamplingParams

    prompt = ProcessedPrompt([1, 2, 3], [], None, 0)
    add = AddRequest("r", ["r"], [SamplingParams(max_tokens=1)], prompt, [], pooling_params=PoolingParams(8, False))
    assert to_engine_decoder.decode(encoder.encode(add)).pooling_params == PoolingParams(8, False)
    vector = torch.randn(8)
    out = from_engine_decoder.decode(
        encoder.encode(StepOutputs([EngineCoreOutput("r", [], "stop", None, 0, pooled=vector)]))
    )
    assert isinstance(out, StepOutputs)
    assert out.outputs[0].pooled is not None and torch.equal(out.outputs[0].pooled, vector)
