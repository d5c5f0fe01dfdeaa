"""vlmserve's pooling runner against transformers on the same tiny Qwen3-VL-Embedding and
Qwen3-VL-Reranker checkpoints (tests/reference_pooling.py: the official scripts' prompts and
pooling): float32 embeddings of text, one image, two images and a video at cosine similarity
>= 0.99999, Matryoshka dimensions, reranker scores within 1e-4; a batch equal to its inputs alone,
chunked prefill and a prefix-cache hit equal to a whole prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests import reference_pooling as ref
from tests.conftest import random_image
from tests.pooling.conftest import hf_image_processor, hf_model
from vlmserve import LLM, PoolingParams

# The tests that compare with transformers run again against its newest release (.ci/run).
parity = pytest.mark.parity

IMAGE = random_image(64, 96, seed=1)
OTHER_IMAGE = random_image(64, 96, seed=2)
FRAMES = tuple(random_image(64, 64, seed=10 + k) for k in range(4))
VIDEO = ref.Video(FRAMES, fps=2.0)
# The same four inputs as the reference's items and as the official object vlmserve takes.
ITEMS = [
    (
        ref.Item(text="A woman playing with her dog on a beach at sunset."),
        {"text": "A woman playing with her dog on a beach at sunset."},
    ),
    (ref.Item(text="a picture", images=(IMAGE,)), {"text": "a picture", "image": IMAGE}),
    (ref.Item(images=(IMAGE, OTHER_IMAGE)), {"image": [IMAGE, OTHER_IMAGE]}),
    (ref.Item(text="a clip", videos=(VIDEO,)), {"text": "a clip", "video": list(FRAMES), "fps": 2.0}),
]
LABELS = ["text", "image", "two-images", "video"]
REFERENCE_ITEMS = [reference for reference, _ in ITEMS]
OBJECTS = [mine for _, mine in ITEMS]


def small_llm(model_dir: Path, **kwargs: Any) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=512, kv_cache_memory_gib=0.01, **kwargs)


@pytest.fixture(scope="module")
def embedder(embedding_dir: Path) -> tuple[Any, Any, Any]:
    return hf_model(embedding_dir), ref.load_tokenizer(embedding_dir), hf_image_processor(embedding_dir)


@pytest.fixture(scope="module")
def embedding_llm(embedding_dir: Path) -> LLM:
    return small_llm(embedding_dir)  # runner "auto": the checkpoint's sentence-transformers files say pooling


@pytest.fixture(scope="module")
def reference_embeddings(embedder: tuple[Any, Any, Any]) -> torch.Tensor:
    return ref.embed(*embedder, REFERENCE_ITEMS)


def embeddings(outputs: list[Any]) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


@pytest.mark.parametrize("index", range(len(ITEMS)), ids=LABELS)
@parity
def test_an_embedding_is_transformers_pooled_normalised_hidden_state(
    embedding_llm: LLM, reference_embeddings: torch.Tensor, index: int
) -> None:
    ours = embeddings(embedding_llm.embed(OBJECTS[index]))[0]
    expected = reference_embeddings[index]
    assert ours.shape == expected.shape == (64,)
    assert float(ours.norm()) == pytest.approx(1.0, abs=1e-6)
    assert float(F.cosine_similarity(ours, expected, dim=0)) >= 0.99999
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-3)


@parity
def test_a_batch_equals_its_inputs_alone_and_the_inputs_differ(
    embedding_llm: LLM, reference_embeddings: torch.Tensor
) -> None:
    batch = embeddings(embedding_llm.embed(OBJECTS))
    alone = torch.cat([embeddings(embedding_llm.embed(item)) for item in OBJECTS])
    torch.testing.assert_close(batch, alone, atol=1e-5, rtol=1e-4)
    for row, expected in zip(batch, reference_embeddings, strict=True):
        assert float(F.cosine_similarity(row, expected, dim=0)) >= 0.99999
    similarity = batch @ batch.T
    assert float((similarity - torch.eye(len(OBJECTS))).abs().max()) > 1e-3  # no two inputs alike


@parity
def test_the_messages_form_is_the_objects_conversation(embedding_llm: LLM, reference_embeddings: torch.Tensor) -> None:
    """A conversation written out (system instruction, user content, the image bounded as the
    official script bounds it) is rendered as the object's."""
    conversation = ref.embedding_messages(ref.Item(text="a picture", images=(IMAGE,)))
    conversation[1]["content"][0] |= {"min_pixels": ref.MIN_PIXELS, "max_pixels": ref.EMBEDDING_MAX_PIXELS}
    ours = embeddings(embedding_llm.embed([conversation]))[0]
    assert float(F.cosine_similarity(ours, reference_embeddings[1], dim=0)) >= 0.99999


@parity
def test_an_instruction_is_the_official_one(embedding_llm: LLM, embedder: tuple[Any, Any, Any]) -> None:
    """ "Retrieve images" becomes "Retrieve images." in the system message, as the official script writes it."""
    expected = ref.embed(*embedder, [ref.Item(text="x")], instruction="Retrieve images")[0]
    ours = embeddings(embedding_llm.embed({"text": "x"}, instruction="Retrieve images"))[0]
    plain = embeddings(embedding_llm.embed({"text": "x"}))[0]
    assert float(F.cosine_similarity(ours, expected, dim=0)) >= 0.99999
    assert float(F.cosine_similarity(plain, expected, dim=0)) < 0.9999


@parity
def test_matryoshka_dimensions_truncate_then_normalise(embedding_llm: LLM, embedder: tuple[Any, Any, Any]) -> None:
    for dims in (8, 32):
        expected = ref.embed(*embedder, [REFERENCE_ITEMS[1]], dimensions=dims)[0]
        ours = embeddings(embedding_llm.embed(OBJECTS[1], PoolingParams(dimensions=dims)))[0]
        assert ours.shape == (dims,)
        assert float(F.cosine_similarity(ours, expected, dim=0)) >= 0.99999
    raw = embeddings(embedding_llm.embed(OBJECTS[1], PoolingParams(normalize=False)))[0]
    assert float(raw.norm()) > 1.5  # the pooled hidden state itself: not a unit vector
    for bad in (0, 65):
        with pytest.raises(ValueError, match="between 1 and the model's embedding size 64"):
            embedding_llm.embed(OBJECTS[1], PoolingParams(dimensions=bad))


@parity
def test_chunked_prefill_and_a_prefix_cache_hit_give_the_same_embedding(
    embedding_dir: Path, reference_embeddings: torch.Tensor
) -> None:
    """Prompts in 16-token chunks (a chunk ending inside an image), then the same prompts again
    from the prefix cache: the same vectors."""
    llm = small_llm(embedding_dir, max_num_batched_tokens=16)
    first = embeddings(llm.embed(OBJECTS))
    again = llm.encode(OBJECTS)
    assert all(len(o.prompt_token_ids) > 16 for o in again)
    assert all(o.num_cached_tokens >= 16 for o in again)
    torch.testing.assert_close(torch.stack([o.outputs.data for o in again]), first, atol=1e-5, rtol=1e-4)
    for row, expected in zip(first, reference_embeddings, strict=True):
        assert float(F.cosine_similarity(row, expected, dim=0)) >= 0.99999


# -- reranker --------------------------------------------------------------------------------------

RERANKER = {"architectures": ["Qwen3VLForSequenceClassification"], "classifier_from_token": ["no", "yes"]}
QUERY = "A woman playing with her dog on a beach at sunset."
DOCUMENTS = [
    (ref.Item(text="A dog on a beach."), "A dog on a beach."),
    (ref.Item(images=(IMAGE,)), {"image": IMAGE}),
    (ref.Item(text="clip", videos=(VIDEO,)), {"text": "clip", "video": list(FRAMES), "fps": 2.0}),
]


@pytest.fixture(scope="module")
def reranker_llm(reranker_dir: Path) -> LLM:
    return small_llm(reranker_dir, hf_overrides=RERANKER)


@parity
def test_reranker_scores_are_transformers_yes_no_probability(reranker_llm: LLM, reranker_dir: Path) -> None:
    hf = (hf_model(reranker_dir), ref.load_tokenizer(reranker_dir), hf_image_processor(reranker_dir))
    expected = ref.rerank(*hf, ref.Item(text=QUERY), [doc for doc, _ in DOCUMENTS])
    outputs = reranker_llm.score(QUERY, [doc for _, doc in DOCUMENTS])
    scores = [o.outputs.score for o in outputs]
    assert scores == pytest.approx(expected, abs=1e-4)
    assert len({round(s, 3) for s in scores}) == 3  # three documents, three scores
    alone = [reranker_llm.score(QUERY, doc)[0].outputs.score for _, doc in DOCUMENTS]
    assert alone == pytest.approx(scores, abs=1e-5)
    instructed = ref.rerank(*hf, ref.Item(text=QUERY), [DOCUMENTS[0][0]], instruction="Find dogs.")
    ours = reranker_llm.score(QUERY, DOCUMENTS[0][1], instruction="Find dogs.")[0].outputs.score
    assert ours == pytest.approx(instructed[0], abs=1e-4)
    assert abs(ours - scores[0]) > 1e-4


def test_a_reranker_embeds_nothing_and_a_generation_model_pools_nothing(reranker_llm: LLM, tiny3_dir: Path) -> None:
    with pytest.raises(ValueError, match="serves the pooling task 'score', not 'embed'"):
        reranker_llm.embed("x")
    with pytest.raises(ValueError, match="does not generate text"):
        reranker_llm.generate("x")
    assert not reranker_llm.llm_engine.has_unfinished_requests()
    assert reranker_llm.score(QUERY, "still serving")[0].outputs.score > 0.0
    generator = small_llm(tiny3_dir)
    for call in (lambda: generator.embed("x"), lambda: generator.score("q", "d")):
        with pytest.raises(ValueError, match="need a pooling model, started with runner='pooling'"):
            call()


def test_tensor_parallel_ranks_pool_what_one_process_pools(
    embedding_llm: LLM, reranker_llm: LLM, reranker_dir: Path, embedding_dir: Path
) -> None:
    """tensor_parallel_size=2: the embeddings of one process, and a score whose two tokens' lm_head
    rows live on different ranks ("no" on rank 0, "你好", id 108386, on rank 1: each rank adds the
    row it holds) equal to one process's."""
    overrides = {"classifier_from_token": ["no", "你好"]}
    one = small_llm(reranker_dir, hf_overrides=overrides)
    expected_scores = [o.outputs.score for o in one.score(QUERY, [doc for _, doc in DOCUMENTS[:2]])]
    two = small_llm(reranker_dir, hf_overrides=overrides, tensor_parallel_size=2)
    try:
        scores = [o.outputs.score for o in two.score(QUERY, [doc for _, doc in DOCUMENTS[:2]])]
    finally:
        two.shutdown()
    assert scores == pytest.approx(expected_scores, abs=1e-5)
    yes_no = reranker_llm.score(QUERY, DOCUMENTS[0][1])[0].outputs.score
    assert abs(yes_no - expected_scores[0]) > 1e-3  # the same model: the tokens chose the score
    two_embed = small_llm(embedding_dir, tensor_parallel_size=2)
    try:
        torch.testing.assert_close(
            embeddings(two_embed.embed(OBJECTS[:2])), embeddings(embedding_llm.embed(OBJECTS[:2])), atol=1e-5, rtol=1e-4
        )
    finally:
        two_embed.shutdown()
