"""Qwen-VL-Chat through the offline API: chat with images and history, prompted as the reference's
make_context does, decoded through the paged engine, against a dense transcription of the
reference forward (tests/models/test_qwen_vl.py) run token by token with its KV cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.conftest import random_image
from tests.models.test_qwen_vl import DenseReference
from vlmserve import LLM, SamplingParams
from vlmserve.families.qwen_vl.chat_format import make_context

MAX_NEW = 6
IM_END, IM_START, ENDOFTEXT = 151645, 151644, 151643


@pytest.fixture(scope="module")
def llm(tiny_qwen_vl_dir: Path) -> LLM:
    return LLM(tiny_qwen_vl_dir, dtype="float32", max_model_len=1024, kv_cache_memory_gib=0.02)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    folder = tmp_path_factory.mktemp("pictures")
    paths = []
    for k, size in enumerate([(150, 100), (60, 90)]):
        path = folder / f"p{k}.png"
        random_image(*size, seed=10 + k).save(path)
        paths.append(str(path))
    return paths


def conversations(pictures: list[str]) -> list[list[dict]]:
    first, second = pictures
    return [
        # An image, an answer, then a question about a second image: history plus query.
        [
            {"role": "user", "content": [{"type": "image", "image": first}, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": "A gradient."},
            {"role": "user", "content": [{"image": second}, {"text": "And this one?"}]},  # Qwen-VL's own format
        ],
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "1+1=?"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": second}}, "Describe it."]}],
    ]


def reference_greedy(ckpt: Path, ids: list[int], pixels: torch.Tensor | None, stop: set[int]) -> list[int]:
    ref = DenseReference(
        {k: t.float() for k, t in load_file(str(ckpt / "model.safetensors")).items()},
        json.loads((ckpt / "config.json").read_text()),
    )
    logits = ref(ref.prompt_embeds(ids, pixels))
    out: list[int] = []
    while len(out) < MAX_NEW:
        token = int(logits[-1].argmax())
        out.append(token)
        if token in stop:
            break
        logits = ref(F.embedding(torch.tensor([token]), ref.sd["transformer.wte.weight"]))
    return out


def test_chat_with_images_and_history_matches_the_reference(
    llm: LLM, pictures: list[str], tiny_qwen_vl_dir: Path
) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    convs = conversations(pictures)
    together = llm.chat(convs, greedy)
    alone = [llm.chat(conv, greedy)[0] for conv in convs]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]

    # The prompt is make_context's: the default system, history as earlier turns, pictures numbered
    # across the conversation with their paths inside <img>...</img>.
    tokenizer = llm.get_tokenizer()
    first, second = pictures
    _, expected_ids = make_context(
        tokenizer,  # type: ignore[arg-type]
        f"Picture 2: <img>{second}</img>\nAnd this one?",
        history=[(f"Picture 1: <img>{first}</img>\nWhat is it?", "A gradient.")],
        system="You are a helpful assistant.",
    )
    assert together[0].prompt_token_ids == expected_ids
    assert len(expected_ids) > 2 * 256 > 64  # past seq_length: dynamic NTK and logn in play
    assert [item.original_size for item in together[0].mm_items] == [(150, 100), (60, 90)]

    stop = {IM_END, IM_START, ENDOFTEXT}
    processor = llm.llm_engine.processor
    for output in together:
        prompt = processor.process(output.prompt_token_ids)
        pixels = torch.stack([item.pixel_values for item in prompt.mm_items]) if prompt.mm_items else None
        assert output.outputs[0].token_ids == reference_greedy(tiny_qwen_vl_dir, output.prompt_token_ids, pixels, stop)
    engine = llm.llm_engine
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_generate_with_an_image_path_in_the_prompt(llm: LLM, pictures: list[str]) -> None:
    """The reference's own way: the image's path travels inside the token ids."""
    prompt = f"<|im_start|>user\nPicture 1: <img>{pictures[0]}</img>\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
    (output,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3))
    assert [item.length for item in output.mm_items] == [256]
    assert llm.get_tokenizer().decode(output.prompt_token_ids, skip_special_tokens=False) == prompt


def test_bad_images_are_named_and_the_llm_goes_on(llm: LLM, pictures: list[str]) -> None:
    bad = [{"role": "user", "content": [{"type": "image", "image": "/no/such.png"}, {"type": "text", "text": "?"}]}]
    with pytest.raises(ValueError, match=r"no/such\.png"):
        llm.chat(bad)
    too_long = "x" * 300
    with pytest.raises(ValueError, match="256"):
        llm.generate(f"<img>{too_long}</img>")
    assert llm.chat(conversations(pictures)[1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_token_handles_are_refused_with_the_way_this_family_does_it(llm: LLM, pictures: list[str]) -> None:
    with pytest.raises(ValueError, match="carry each image's path"):
        llm.tokenize([{"image": pictures[0]}, {"text": "What is it?"}])
