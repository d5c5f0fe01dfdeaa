"""tests/reference_pooling.py against computations that do not share its pooling: the prompts
against the official scripts' formats written out by hand, an embedding against the final norm's
output captured by a hook on a prompt run alone (no padding), a reranker score against the
softmax over the full vocabulary's "no" and "yes" logits; and the properties a server relies on
(unit norm, a batch equal to its items alone, Matryoshka truncation before normalisation)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests import reference_pooling as ref
from tests.conftest import random_image
from tests.pooling.conftest import hf_image_processor, hf_model
from tests.reference import IMAGE_TOKEN_ID, mm_token_type_ids

# Sides that are multiples of 32: the official resize keeps them.
IMAGE = random_image(64, 96, seed=1)
OTHER_IMAGE = random_image(64, 96, seed=2)
VIDEO = ref.Video(tuple(random_image(64, 64, seed=10 + k) for k in range(4)), fps=2.0)
ITEMS = [
    ref.Item(text="A woman playing with her dog on a beach at sunset."),
    ref.Item(text="a picture", images=(IMAGE,)),
    ref.Item(images=(IMAGE, OTHER_IMAGE)),
    ref.Item(text="a clip", videos=(VIDEO,)),
]
SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the "
    'answer can only be "yes" or "no".'
)


@pytest.fixture(scope="module")
def embedder(embedding_dir: Path) -> tuple[Any, Any, Any]:
    return hf_model(embedding_dir), ref.load_tokenizer(embedding_dir), hf_image_processor(embedding_dir)


@pytest.fixture(scope="module")
def reranker(reranker_dir: Path) -> tuple[Any, Any, Any]:
    return hf_model(reranker_dir), ref.load_tokenizer(reranker_dir), hf_image_processor(reranker_dir)


def final_norm_output(
    model: Any, tokenizer: Any, processor: Any, messages: list[dict[str, Any]], max_pixels: int
) -> torch.Tensor:
    """[seq, hidden]: the language model's final norm's output for one prompt run alone, unpadded."""
    ids, vision = ref.prompt_inputs(tokenizer, processor, messages, max_pixels)
    input_ids = torch.tensor([ids])
    captured: list[torch.Tensor] = []
    hook = model.model.language_model.norm.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        with torch.no_grad():
            model(input_ids=input_ids, mm_token_type_ids=mm_token_type_ids(input_ids), **vision)
    finally:
        hook.remove()
    return captured[0][0]


# -- prompts -------------------------------------------------------------------------------------


def test_embedding_prompts_are_the_official_scripts(embedder: tuple[Any, Any, Any]) -> None:
    _, tokenizer, _ = embedder
    head = "<|im_start|>system\n"
    tail = "<|im_end|>\n<|im_start|>assistant\n"
    text = ref.render(tokenizer, ref.embedding_messages(ref.Item(text="hello")))
    assert text == head + "Represent the user's input.<|im_end|>\n<|im_start|>user\nhello" + tail
    # An instruction without final punctuation gets a full stop; one with it is kept.
    text = ref.render(tokenizer, ref.embedding_messages(ref.Item(text="hi"), " Retrieve images "))
    assert text.startswith(head + "Retrieve images.<|im_end|>")
    assert ref.render(tokenizer, ref.embedding_messages(ref.Item(text="hi"), "Which one?")).startswith(
        head + "Which one?<|im_end|>"
    )
    # Videos, then images, then the text; an empty item is "NULL".
    both = ref.render(tokenizer, ref.embedding_messages(ref.Item(text="t", images=(IMAGE,), videos=(VIDEO,))))
    assert both.endswith(
        "user\n<|vision_start|><|video_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>t" + tail
    )
    assert ref.render(tokenizer, ref.embedding_messages(ref.Item())).endswith("user\nNULL" + tail)


def test_reranker_prompts_are_the_official_scripts(reranker: tuple[Any, Any, Any]) -> None:
    """The text vLLM's qwen3_vl_reranker.jinja writes for a text pair, and the media in place."""
    _, tokenizer, _ = reranker
    text = ref.render(tokenizer, ref.reranker_messages(ref.Item(text="q?"), ref.Item(text="d.")))
    assert text == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
        "<Instruct>: Given a search query, retrieve relevant candidates that answer the query.<Query>:q?\n"
        "<Document>:d.<|im_end|>\n<|im_start|>assistant\n"
    )
    text = ref.render(tokenizer, ref.reranker_messages(ref.Item(text="q"), ref.Item(images=(IMAGE,)), "Find it."))
    assert "<Instruct>: Find it.<Query>:q\n<Document>:<|vision_start|><|image_pad|><|vision_end|><|im_end|>" in text


def test_the_pooled_token_is_the_newline_of_the_generation_prompt(embedder: tuple[Any, Any, Any]) -> None:
    _, tokenizer, processor = embedder
    ids, _ = ref.prompt_inputs(tokenizer, processor, ref.embedding_messages(ITEMS[0]), ref.EMBEDDING_MAX_PIXELS)
    assert tokenizer.decode(ids[-3:]) == "<|im_start|>assistant\n"


def test_yes_and_no_are_single_tokens(reranker: tuple[Any, Any, Any]) -> None:
    _, tokenizer, _ = reranker
    yes, no = ref.yes_no_ids(tokenizer)
    assert (yes, no) == (9693, 2152)
    assert tokenizer("yes", add_special_tokens=False)["input_ids"] == [yes]
    assert tokenizer("no", add_special_tokens=False)["input_ids"] == [no]


# -- embeddings ----------------------------------------------------------------------------------


def test_a_padded_batch_equals_each_prompts_last_normed_hidden_state(embedder: tuple[Any, Any, Any]) -> None:
    """Text, one image, two images, a video, of four lengths in one right-padded batch: each row is
    the final norm's output at its prompt's last token (run alone), L2-normalised."""
    model, tokenizer, processor = embedder
    batch = ref.embed(model, tokenizer, processor, ITEMS)
    assert batch.shape == (len(ITEMS), 64)
    torch.testing.assert_close(batch.norm(dim=-1), torch.ones(len(ITEMS)))
    for row, item in zip(batch, ITEMS, strict=True):
        hidden = final_norm_output(model, tokenizer, processor, ref.embedding_messages(item), ref.EMBEDDING_MAX_PIXELS)
        last = hidden[-1]
        torch.testing.assert_close(row, last / last.pow(2).sum().sqrt(), atol=2e-5, rtol=1e-4)
    alone = torch.cat([ref.embed(model, tokenizer, processor, [item]) for item in ITEMS])
    torch.testing.assert_close(batch, alone, atol=2e-5, rtol=1e-4)


def test_the_pixels_and_the_instruction_move_the_embedding(embedder: tuple[Any, Any, Any]) -> None:
    model, tokenizer, processor = embedder
    other_video = ref.Video(tuple(reversed(VIDEO.frames)), fps=2.0)
    a, b, c, d, e, f = ref.embed(
        model,
        tokenizer,
        processor,
        [
            ref.Item(images=(IMAGE,)),
            ref.Item(images=(OTHER_IMAGE,)),
            ref.Item(videos=(VIDEO,)),
            ref.Item(videos=(other_video,)),
            ref.Item(text="x"),
            ref.Item(text="x"),
        ],
    )
    assert float(a @ b) < 0.9999 and float(c @ d) < 0.9999
    g = ref.embed(model, tokenizer, processor, [ref.Item(text="x")], instruction="Retrieve images")[0]
    torch.testing.assert_close(e, f)
    assert float(e @ g) < 0.9999


def test_matryoshka_truncates_then_normalises(embedder: tuple[Any, Any, Any]) -> None:
    model, tokenizer, processor = embedder
    item = ITEMS[1]
    last = final_norm_output(model, tokenizer, processor, ref.embedding_messages(item), ref.EMBEDDING_MAX_PIXELS)[-1]
    full = ref.embed(model, tokenizer, processor, [item])[0]
    for dims in (8, 32, 64):
        short = ref.embed(model, tokenizer, processor, [item], dimensions=dims)[0]
        assert short.shape == (dims,)
        torch.testing.assert_close(short, F.normalize(last[:dims], dim=-1), atol=2e-5, rtol=1e-4)
    # Not the prefix of the full unit vector: that one's norm is below 1.
    assert float(full[:8].norm()) < 0.99
    for bad in (0, 65):
        with pytest.raises(ValueError, match="dimensions must be in 1..64"):
            ref.embed(model, tokenizer, processor, [item], dimensions=bad)


# -- reranker scores ------------------------------------------------------------------------------


def test_a_score_is_the_softmax_of_the_no_and_yes_logits(reranker: tuple[Any, Any, Any]) -> None:
    """Three documents (text, an image, a video) of three lengths in one left-padded batch: each
    score is softmax([logit(no), logit(yes)])[1] of the full lm_head at the pair's last token."""
    model, tokenizer, processor = reranker
    query = ref.Item(text="A woman playing with her dog on a beach at sunset.")
    documents = [ref.Item(text="A dog on a beach."), ref.Item(images=(IMAGE,)), ref.Item(text="clip", videos=(VIDEO,))]
    scores = ref.rerank(model, tokenizer, processor, query, documents)
    yes, no = ref.yes_no_ids(tokenizer)
    expected = []
    for doc in documents:
        ids, vision = ref.prompt_inputs(
            tokenizer, processor, ref.reranker_messages(query, doc), ref.RERANKER_MAX_PIXELS
        )
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=input_ids, mm_token_type_ids=mm_token_type_ids(input_ids), **vision).logits
        expected.append(float(torch.softmax(logits[0, -1, [no, yes]], dim=-1)[1]))
    assert scores == pytest.approx(expected, abs=1e-5)
    assert all(0.0 < s < 1.0 for s in scores) and len(set(scores)) == 3
    alone = [ref.rerank(model, tokenizer, processor, query, [doc])[0] for doc in documents]
    assert scores == pytest.approx(alone, abs=1e-5)


def test_the_score_reads_the_lm_head_not_the_embedding(reranker: tuple[Any, Any, Any]) -> None:
    """The reranker checkpoint is untied: the same formula over embed_tokens' rows gives another score."""
    model, tokenizer, processor = reranker
    query, doc = ref.Item(text="q"), ref.Item(text="d")
    score = ref.rerank(model, tokenizer, processor, query, [doc])[0]
    hidden = final_norm_output(model, tokenizer, processor, ref.reranker_messages(query, doc), ref.RERANKER_MAX_PIXELS)
    yes, no = ref.yes_no_ids(tokenizer)
    embedding = model.model.language_model.embed_tokens.weight.detach()
    assert score != pytest.approx(float(torch.sigmoid(hidden[-1] @ (embedding[yes] - embedding[no]))), abs=1e-3)


def test_an_image_document_is_resized_as_the_official_script(reranker: tuple[Any, Any, Any]) -> None:
    """A 40 x 30 image is under the scripts' minimum of 4 x 32 x 32 pixels: scaled by
    sqrt(4096 / 1200) and each side rounded up to a multiple of 32, it becomes 96 x 64, a 6 x 4 grid
    of 16-pixel patches and 6 image tokens (the checkpoint processor's own minimum, 65536 pixels,
    would make it 320 x 224)."""
    _, tokenizer, processor = reranker
    small = Image.new("RGB", (40, 30), (200, 10, 10))
    ids, vision = ref.prompt_inputs(
        tokenizer,
        processor,
        ref.reranker_messages(ref.Item(text="q"), ref.Item(images=(small,))),
        ref.RERANKER_MAX_PIXELS,
    )
    assert vision["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert ids.count(IMAGE_TOKEN_ID) == 6
