"""LoRA adapters served by vlmserve against transformers + PEFT on the same checkpoint, adapter
files and prompt: greedy tokens identical, prompt and sample logprobs within the parity tests'
1e-4 of PEFT's log-softmax. One LLM per family serves every adapter of that family (max_loras=4);
the adapters target the language model, the vision tower (patch embedding, blocks, merger(s)) or
both, ranks 8 and 16, rsLoRA and per-module ranks (rank_pattern / alpha_pattern) spread over the
families.

Then, without transformers: a batch mixing three adapters and the base model gives each request
the tokens it gets alone, also when the pool holds fewer adapters than the batch names."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from tests.conftest import random_image
from tests.entrypoints.test_llm_prompt_logprobs import check
from tests.lora_adapters import LANGUAGE_MODEL, VISION_TOWER, WHOLE_MODEL, base_model, peft_model, write_adapter
from tests.reference import hf_mm_greedy, hf_mm_logits, hf_mm_prompt_ids
from vlmserve import LLM, SamplingParams
from vlmserve.lora import LoRARequest

FAMILIES = {"qwen2_vl": "tiny_dir", "qwen2_5_vl": "tiny25_dir", "qwen3_vl": "tiny3_dir"}
TARGETS = {"language_model": LANGUAGE_MODEL, "vision_tower": VISION_TOWER, "both": WHOLE_MODEL}

# (family, target) -> write_adapter's r, alpha and LoraConfig options: every family has a rank 8
# and a rank 16 adapter, and one with rsLoRA's scaling (alpha / sqrt(r)) or with per-module ranks
# and alphas (PEFT matches a pattern key against the end of a module's name: "o_proj" every layer's,
# r"layers\.1\.mlp\.down_proj" one layer's).
ADAPTERS: dict[tuple[str, str], dict[str, Any]] = {
    ("qwen2_vl", "language_model"): {"r": 8, "alpha": 16},
    ("qwen2_vl", "vision_tower"): {"r": 16, "alpha": 16},
    ("qwen2_vl", "both"): {"r": 8, "alpha": 8, "use_rslora": True},
    ("qwen2_5_vl", "language_model"): {"r": 16, "alpha": 32, "use_rslora": True},
    ("qwen2_5_vl", "vision_tower"): {"r": 8, "alpha": 16, "rank_pattern": {"qkv": 16}, "alpha_pattern": {"qkv": 8}},
    ("qwen2_5_vl", "both"): {"r": 16, "alpha": 16},
    ("qwen3_vl", "language_model"): {
        "r": 8,
        "alpha": 16,
        "rank_pattern": {"o_proj": 16, r"layers\.1\.mlp\.down_proj": 4},
        "alpha_pattern": {"o_proj": 8},
    },
    ("qwen3_vl", "vision_tower"): {"r": 16, "alpha": 32},
    ("qwen3_vl", "both"): {"r": 8, "alpha": 16, "use_rslora": True},
}

PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n<|im_start|>assistant\n"
MAX_TOKENS = 8
K = 2  # prompt_logprobs and logprobs
TOLERANCE = 1e-4  # the parity tests' max absolute error of float32 logprobs
# Tokens per step: every prompt (18 tokens on Qwen2-VL and Qwen2.5-VL, 78 on Qwen3-VL) and its
# image are prefilled in chunks, beside other requests' decode rows in the batch tests.
BUDGET = 16


@pytest.fixture(scope="module")
def image() -> Image.Image:
    """The smallest picture each processor takes as is or scales up to its minimum (Qwen2-VL's
    2 x 2 merged tokens, Qwen3-VL's 8 x 8)."""
    return random_image(32, 32, seed=5)


def request_for(image: Image.Image) -> dict[str, Any]:
    return {"prompt": PROMPT, "multi_modal_data": {"image": [image]}}


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@dataclass
class Served:
    family: str
    model_dir: Path
    llm: LLM
    # target -> the adapter's folder, and the request naming it
    folders: dict[str, Path]
    loras: dict[str, LoRARequest]
    # the base model's greedy tokens for the image prompt, before any adapter was loaded
    base_tokens: list[int]


def serve(model_dir: Path, family: str, folder: Path, max_loras: int, image: Image.Image) -> Served:
    folders = {
        target: write_adapter(
            model_dir, folder / target, target_modules=TARGETS[target], seed=seed, **ADAPTERS[family, target]
        )
        for seed, target in enumerate(TARGETS)
    }
    loras = {
        target: LoRARequest(f"{family}-{target}", i, str(path))
        for i, (target, path) in enumerate(folders.items(), start=1)
    }
    llm = LLM(
        model_dir,
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=BUDGET,
        kv_cache_memory_gib=0.02,
        enable_lora=True,
        max_lora_rank=16,
        max_loras=max_loras,
    )
    base_tokens = list(llm.generate(request_for(image), GREEDY)[0].outputs[0].token_ids)
    return Served(family, model_dir, llm, folders, loras, base_tokens)


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, image: Image.Image
) -> Iterator[Served]:
    """The family's LLM with max_loras=4 and its three adapters (not loaded yet: requests load them)."""
    family = request.param
    model_dir = request.getfixturevalue(FAMILIES[family])
    s = serve(model_dir, family, tmp_path_factory.mktemp(f"lora-{family}"), max_loras=4, image=image)
    yield s
    s.llm.shutdown()


# -- against transformers + PEFT --------------------------------------------------------------------


@pytest.mark.parity
@pytest.mark.parametrize("target", list(TARGETS))
def test_adapter_matches_transformers_peft(served: Served, target: str, image: Image.Image) -> None:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model_dir = served.model_dir
    ids, vision = hf_mm_prompt_ids(
        AutoTokenizer.from_pretrained(str(model_dir)),
        Qwen2VLImageProcessorPil.from_pretrained(str(model_dir)),
        PROMPT,
        [image],
    )
    peft = peft_model(model_dir, served.folders[target])
    expected = hf_mm_greedy(peft, ids, vision, MAX_TOKENS)
    # [len(ids) + MAX_TOKENS - 1, vocab]: row i scores token i + 1 of the prompt and its answer
    ref = torch.log_softmax(hf_mm_logits(peft, ids + expected, vision).double(), dim=-1)[:-1]
    # The adapter changes what the base model says, else matching PEFT would prove nothing.
    base_ref = torch.log_softmax(hf_mm_logits(base_model(model_dir), ids + expected, vision).double(), dim=-1)[:-1]
    assert (ref - base_ref).abs().max() > 1.0

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, prompt_logprobs=K, logprobs=K)
    out = served.llm.generate(request_for(image), params, lora_request=served.loras[target])[0]
    assert out.prompt_token_ids == ids
    generated = out.outputs[0]
    assert list(generated.token_ids) == expected
    check(out.prompt_logprobs, ids, ref[: len(ids) - 1], K)
    assert generated.logprobs is not None and len(generated.logprobs) == len(expected)
    for step, (token, entry) in enumerate(zip(expected, generated.logprobs, strict=True)):
        row = ref[len(ids) - 1 + step]
        assert token in entry
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[tid]), abs=TOLERANCE), (step, tid)


# -- many adapters in one batch ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def alone(served: Served, image: Image.Image) -> list[list[int]]:
    """Qwen2-VL's image prompt run alone with each adapter, then with the base model, each from an
    empty prefix cache. The last leaves the base model's blocks and image encoding cached: a batch
    after it must not read them for its adapters' requests."""

    def run(lora: LoRARequest | None) -> list[int]:
        served.llm.reset_prefix_cache()
        return list(served.llm.generate(request_for(image), GREEDY, lora_request=lora)[0].outputs[0].token_ids)

    tokens = [run(lora) for lora in [*served.loras.values(), None]]
    # Each adapter makes the model say something else, else the batch tests would prove nothing.
    assert len({tuple(t) for t in tokens}) == len(tokens), tokens
    # Loading adapters left the base model as it was.
    assert tokens[-1] == served.base_tokens
    return tokens


@pytest.mark.parametrize("served", ["qwen2_vl"], indirect=True)
def test_batch_mixing_adapters_gives_each_request_its_own_tokens(
    served: Served, image: Image.Image, alone: list[list[int]]
) -> None:
    loras = [*served.loras.values(), None]
    # The same prompt and image under every adapter and the base model, in one step, twice over in
    # another order (rows of one adapter need not be next to each other).
    order = [0, 1, 2, 3, 3, 2, 1, 0]
    outs = served.llm.generate([request_for(image)] * len(order), GREEDY, lora_request=[loras[i] for i in order])
    assert [list(o.outputs[0].token_ids) for o in outs] == [alone[i] for i in order]
    assert [lora.lora_name for lora in served.llm.llm_engine.list_loras()] == [lora.lora_name for lora in loras[:3]]


@pytest.mark.parametrize("served", ["qwen2_vl"], indirect=True)
def test_fewer_adapter_slots_than_adapters_in_a_batch(
    served: Served, image: Image.Image, alone: list[list[int]], tmp_path: Path
) -> None:
    """max_loras=2 and three adapters in one call: the pool swaps adapters between steps, and every
    request still gets its own adapter's tokens."""
    small = serve(served.model_dir, served.family, tmp_path, max_loras=2, image=image)
    try:
        loras = [*small.loras.values(), None]
        order = [2, 3, 0, 1, 0, 2]
        outs = small.llm.generate([request_for(image)] * len(order), GREEDY, lora_request=[loras[i] for i in order])
        assert [list(o.outputs[0].token_ids) for o in outs] == [alone[i] for i in order]
    finally:
        small.llm.shutdown()


@pytest.mark.parametrize("served", ["qwen2_vl"], indirect=True)
def test_chat_takes_lora_request(served: Served, image: Image.Image) -> None:
    """chat() runs its conversations with the adapter given, as generate() does its prompts."""
    lora = served.loras["both"]
    messages = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is this?"}]}
    ]
    chat = served.llm.chat([messages, messages], GREEDY, lora_request=[lora, None])
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    prompt = {"prompt": system + PROMPT, "multi_modal_data": {"image": [image]}}
    outs = served.llm.generate([prompt, prompt], GREEDY, lora_request=[lora, None])
    assert [c.prompt_token_ids for c in chat] == [o.prompt_token_ids for o in outs]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert [list(c.outputs[0].token_ids) for c in chat] == tokens and tokens[0] != tokens[1]
    # One LoRARequest for every conversation.
    both = served.llm.chat([messages, messages], GREEDY, lora_request=lora)
    assert [list(c.outputs[0].token_ids) for c in both] == [tokens[0], tokens[0]]


@pytest.mark.parametrize("served", ["qwen2_vl"], indirect=True)
def test_adapter_under_transformers_4_names(
    served: Served, image: Image.Image, alone: list[list[int]], tmp_path: Path
) -> None:
    """Adapters trained before transformers 5 name the language model's layers
    base_model.model.model.layers.N and the tower's base_model.model.visual.blocks.N (the
    checkpoint's own names): the same adapter under those names gives the same tokens."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "old-names"
    shutil.copytree(served.folders["both"], folder)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    renamed = {
        key.replace("model.model.language_model.", "model.model.").replace("model.model.visual.", "model.visual."): t
        for key, t in weights.items()
    }
    assert not any("language_model" in key for key in renamed) and len(renamed) == len(weights)
    save_file(renamed, str(folder / "adapter_model.safetensors"))
    out = served.llm.generate(request_for(image), GREEDY, lora_request=LoRARequest("old-names", 9, str(folder)))[0]
    assert list(out.outputs[0].token_ids) == alone[2]


@pytest.mark.parametrize("served", ["qwen2_vl"], indirect=True)
def test_tensor_parallel_ranks_hold_their_slices_of_each_adapter(
    served: Served, image: Image.Image, alone: list[list[int]]
) -> None:
    """tensor_parallel_size=2 (two gloo rank processes): each rank holds its slices of A (row-
    parallel layers: summed over the ranks) or of B (column-parallel, fused parts each sliced),
    of the tower's too; the mixed batch gets the single process's tokens."""
    two = LLM(
        served.model_dir,
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=BUDGET,
        kv_cache_memory_gib=0.02,
        enable_lora=True,
        max_lora_rank=16,
        max_loras=4,
        tensor_parallel_size=2,
    )
    try:
        loras = [*served.loras.values(), None]
        outs = two.generate([request_for(image)] * 4, GREEDY, lora_request=loras)
        assert [list(o.outputs[0].token_ids) for o in outs] == alone
    finally:
        two.shutdown()
