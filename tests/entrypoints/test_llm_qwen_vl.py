"""Qwen-VL-Chat through the offline API: chat with images and history, prompted as the reference's
make_context does, decoded through the paged engine, against a dense transcription of the
reference forward (tests/models/test_qwen_vl.py) run token by token with its KV cache."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file

from tests.api.conftest import segments_left
from tests.conftest import random_image
from tests.models.test_qwen_vl import DenseReference
from tests.qwen_vl.test_processor import seed_pixels
from vlmserve import LLM, SamplingParams
from vlmserve.families.qwen_vl.chat_format import make_context
from vlmserve.ipc import shm
from vlmserve.multimodal import handles
from vlmserve.outputs import RequestOutput

MAX_NEW = 6
IM_END, IM_START, ENDOFTEXT = 151645, 151644, 151643
STOP = {IM_END, IM_START, ENDOFTEXT}
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


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


Reference = Callable[[list[int], torch.Tensor | None], tuple[list[int], list[torch.Tensor]]]


@pytest.fixture(scope="module")
def reference(tiny_qwen_vl_dir: Path) -> Reference:
    """Greedy decoding through the dense reference (stopping at <|im_end|>, <|im_start|> or
    <|endoftext|>, or after MAX_NEW tokens): the tokens and, for each, the log-softmax of the
    logits it was picked from."""
    weights = {k: t.float() for k, t in load_file(str(tiny_qwen_vl_dir / "model.safetensors")).items()}
    config = json.loads((tiny_qwen_vl_dir / "config.json").read_text())

    def run(ids: list[int], pixels: torch.Tensor | None) -> tuple[list[int], list[torch.Tensor]]:
        ref = DenseReference(weights, config)
        logits = ref(ref.prompt_embeds(ids, pixels))
        tokens: list[int] = []
        logprobs: list[torch.Tensor] = []
        while len(tokens) < MAX_NEW:
            tokens.append(int(logits[-1].argmax()))
            logprobs.append(torch.log_softmax(logits[-1].double(), dim=-1))
            if tokens[-1] in STOP:
                break
            logits = ref(F.embedding(torch.tensor(tokens[-1:]), ref.sd["transformer.wte.weight"]))
        return tokens, logprobs

    return run


def assert_matches_reference(output: RequestOutput, expected: tuple[list[int], list[torch.Tensor]]) -> None:
    """Same tokens, and every reported logprob within 1e-4 of the reference's."""
    tokens, logprobs = expected
    completion = output.outputs[0]
    assert completion.token_ids == tokens
    assert completion.logprobs is not None and len(completion.logprobs) == len(logprobs)
    for step, (entry, ref) in enumerate(zip(completion.logprobs, logprobs, strict=True)):
        worst = max(abs(lp.logprob - float(ref[token_id])) for token_id, lp in entry.items())
        assert worst < 1e-4, f"token {step}: logprobs off by {worst:.2e}"


def test_chat_with_images_and_history_matches_the_reference(
    llm: LLM, pictures: list[str], reference: Reference
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

    processor = llm.llm_engine.processor
    for output in together:
        prompt = processor.process(output.prompt_token_ids)
        pixels = torch.stack([item.pixel_values for item in prompt.mm_items]) if prompt.mm_items else None
        assert output.outputs[0].token_ids == reference(output.prompt_token_ids, pixels)[0]
    engine = llm.llm_engine
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_an_image_path_in_the_prompt_is_loaded_and_answered_as_chat_and_the_reference_do(
    llm: LLM, pictures: list[str], reference: Reference
) -> None:
    """The reference's own way: the image's path travels inside the token ids."""

    def prompt_for(path: str) -> str:
        user = f"<|im_start|>user\nPicture 1: <img>{path}</img>\nWhat is it?<|im_end|>\n"
        return f"{SYSTEM}{user}<|im_start|>assistant\n"

    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5)
    prompt = prompt_for(pictures[0])
    (output,) = llm.generate(prompt, params)
    assert llm.get_tokenizer().decode(output.prompt_token_ids, skip_special_tokens=False) == prompt
    assert [(item.length, item.original_size) for item in output.mm_items] == [(256, (150, 100))]  # that file
    # The reference forward, on the file's pixels preprocessed as the seed describes (448 x 448
    # bicubic, CLIP mean and std), gives the same tokens and logprobs.
    pixels = seed_pixels(Image.open(pictures[0]))[None]
    assert_matches_reference(output, reference(output.prompt_token_ids, pixels))
    # Chat with the same picture and question makes this very prompt, and answers the same.
    (chat,) = llm.chat([{"role": "user", "content": [{"image": pictures[0]}, {"text": "What is it?"}]}], params)
    assert chat.prompt_token_ids == output.prompt_token_ids
    assert chat.outputs[0].token_ids == output.outputs[0].token_ids
    # Another file named in the same place is another picture: the answer's distribution moves (the
    # random weights tend to keep the greedy tokens).
    (other,) = llm.generate(prompt_for(pictures[1]), params)
    assert [item.original_size for item in other.mm_items] == [(60, 90)]
    assert output.outputs[0].logprobs is not None and other.outputs[0].logprobs is not None
    first, moved = output.outputs[0].logprobs[0], other.outputs[0].logprobs[0]
    assert max(abs(first[t].logprob - moved[t].logprob) for t in first.keys() & moved.keys()) > 0.01


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_prompts_in_different_ntk_bases_share_no_cached_blocks_and_prompts_in_one_base_do(
    llm: LLM, reference: Reference, tiny_qwen_vl_dir: Path
) -> None:
    """Qwen-VL-Chat rotates a prompt's keys with a base its length picks (dynamic NTK: one base up
    to seq_length tokens, another up to twice that, ...). Cached KV of a prompt in one base is
    wrong for a prompt in another, even where their tokens agree; in the same base it is right."""
    seq_length = json.loads((tiny_qwen_vl_dir / "config.json").read_text())["seq_length"]
    shared = (
        f"{SYSTEM}<|im_start|>user\nLighthouses on this coast, from north to south: Longstone, Souter, "
        "Flamborough, Spurn, Cromer, Lowestoft and Orfordness. "
    )
    questions = [
        "Which is oldest?",
        "Which of them still has a keeper living on site, which was the last to be automated, and which can "
        "visitors climb today?",
        "Sort them by the height of the tower, give the year each light was first lit, and say which ones are now "
        "museums.",
    ]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5)
    llm.reset_prefix_cache()
    short, long, other_long = (
        llm.generate(f"{shared}{q}<|im_end|>\n<|im_start|>assistant\n", params)[0] for q in questions
    )
    lengths = [len(o.prompt_token_ids) for o in (short, long, other_long)]
    assert lengths[0] <= seq_length < lengths[1] <= lengths[2] <= 2 * seq_length, lengths
    block = llm.llm_engine.kv.block_size
    assert common_prefix(short.prompt_token_ids, long.prompt_token_ids) >= 3 * block  # 3 full blocks alike
    assert short.num_cached_tokens == 0
    assert long.num_cached_tokens == 0  # short's blocks were computed in the other base
    shared_blocks = common_prefix(long.prompt_token_ids, other_long.prompt_token_ids) // block
    assert shared_blocks >= 3 and other_long.num_cached_tokens == shared_blocks * block
    # Each long one answers as the reference does with the prompt alone.
    for output in (long, other_long):
        assert_matches_reference(output, reference(output.prompt_token_ids, None))


def test_bad_images_are_named_and_the_llm_goes_on(llm: LLM, pictures: list[str]) -> None:
    bad = [{"role": "user", "content": [{"type": "image", "image": "/no/such.png"}, {"type": "text", "text": "?"}]}]
    with pytest.raises(ValueError, match=r"no/such\.png"):
        llm.chat(bad)
    too_long = "x" * 300
    with pytest.raises(ValueError, match="256"):
        llm.generate(f"<img>{too_long}</img>")
    assert llm.chat(conversations(pictures)[1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


# -- the list-of-dicts input, shared-memory handles after <img> ----------------------

IMG, IMG_END, IMG_PAD = 151857, 151858, 151859  # config.json's visual.image_start_id, + 1, + 2


def test_seed_004_handles_sit_after_img_and_generate_what_chat_does(llm: LLM, pictures: list[str]) -> None:
    inputs = [{"text": "Look:"}, {"image": pictures[0]}, {"text": "What is it?"}]
    chat = [{"role": "user", "content": [{"type": k, k: v} for entry in inputs for k, v in entry.items()]}]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=3)
    ids = llm.tokenize(inputs)
    expected = llm.chat(chat, params)[0]
    rendered = expected.prompt_token_ids
    p = rendered.index(IMG)
    # The contract's worked example: the prompt as chat renders it ("Picture 1: <img>PATH</img>\n"),
    # the segment's name at <img> + 1 and the shape of its pixels at <img> + 2, nothing else.
    assert len(ids) == len(rendered) and rendered[p + 257] == IMG_END
    assert [k for k, (a, b) in enumerate(zip(ids, rendered, strict=True)) if a != b] == [p + 1, p + 2]
    name = shm.handle_to_name(ids[p + 1])
    assert ids[p + 2] == 0x6000_2000_C0E0_01C0  # (1, 3, 448, 448): image_pixel[None, :]
    stored = np.fromfile(f"/dev/shm/{name}", dtype=np.float32).reshape(1, 3, 448, 448)
    assert np.array_equal(stored[0], llm.llm_engine.processor.process(rendered).mm_items[0].pixel_values.numpy())

    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    assert segments_left() == []
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert out.outputs[0].logprobs == expected.outputs[0].logprobs
    # The engine filled the span from the segment: it names no URL now.
    assert out.prompt_token_ids == [*rendered[: p + 1], *[IMG_PAD] * 256, *rendered[p + 257 :]]


def test_seed_004_bad_handles_and_inputs_are_named_and_segments_freed(llm: LLM, pictures: list[str]) -> None:
    with pytest.raises(ValueError, match=r"inputs\[1\]: Qwen-VL-Chat has no video input"):
        llm.tokenize([{"text": "x"}, {"video": "clip.mp4"}])
    with pytest.raises(ValueError, match=r"inputs\[0\]\.audio: this model has no audio input"):
        llm.tokenize([{"audio": "a.mp3"}])
    ids = llm.tokenize([{"image": pictures[1]}, {"text": "?"}])
    p = ids.index(IMG)
    wrong_shape = [*ids[: p + 2], handles.shape_to_int64((1, 3, 224, 224)), *ids[p + 3 :]]
    with pytest.raises(ValueError, match=r"holds \(1, 3, 224, 224\); a Qwen-VL image is \(1, 3, 448, 448\)"):
        llm.generate({"prompt_token_ids": wrong_shape})
    assert segments_left() == []
    unclosed = llm.tokenize([{"image": pictures[1]}, {"text": "?"}])
    unclosed[p + 257] = IMG_PAD
    with pytest.raises(ValueError, match="not closed by </img>"):
        llm.generate({"prompt_token_ids": unclosed})
    assert segments_left() == []
    assert llm.chat(conversations(pictures)[1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
