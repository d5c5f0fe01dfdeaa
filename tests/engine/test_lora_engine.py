"""LoRA adapters in the engine: the caches keep each adapter's KV and image embeddings apart from
the base model's, the engine's list of adapters (add, again, clashes, remove), and the rows of a
step with several adapters (tests/lora holds the parity with transformers + PEFT)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.lora_adapters import LANGUAGE_MODEL, VISION_TOWER, write_adapter
from vlmserve import LLM, SamplingParams
from vlmserve.engine.request import Request
from vlmserve.lora import LoRAError, LoRARequest
from vlmserve.lora.layers import step_rows
from vlmserve.multimodal.inputs import ProcessedPrompt

GREEDY = SamplingParams(max_tokens=6, temperature=0)
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def adapters(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("lora-engine")
    return {
        "lm": LoRARequest("lm", 1, str(write_adapter(tiny_dir, root / "lm", 8, 16, LANGUAGE_MODEL, seed=1))),
        "vision": LoRARequest("vision", 2, str(write_adapter(tiny_dir, root / "vision", 8, 16, VISION_TOWER, seed=2))),
    }


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    # A fixed KV cache: no memory profiling at start (seconds).
    return LLM(
        str(tiny_dir),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_gib=0.01,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )


def _tokens(llm: LLM, prompt: object, lora: LoRARequest | None) -> tuple[list[int], int]:
    out = llm.generate(prompt, GREEDY, lora_request=lora)[0]  # type: ignore[arg-type]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def test_prefix_cache_keeps_an_adapters_kv_apart(llm: LLM, adapters: dict[str, LoRARequest]) -> None:
    # 3 full blocks of 16 tokens: what a prefix-cache hit would reuse.
    prompt = CHAT.format("count the numbers " + " ".join(str(i) for i in range(30)))
    lm = adapters["lm"]
    llm.reset_prefix_cache()
    base, _ = _tokens(llm, prompt, None)
    llm.reset_prefix_cache()
    with_adapter, _ = _tokens(llm, prompt, lm)
    assert with_adapter != base, "the adapter must change the tokens for this test to mean anything"
    # The adapter's blocks are cached now: the base model finds none of them, the adapter all.
    after, cached = _tokens(llm, prompt, None)
    assert (after, cached) == (base, 0)
    again, cached = _tokens(llm, prompt, lm)
    assert again == with_adapter and cached >= 32


def test_encoder_cache_keeps_a_vision_adapters_embeddings_apart(llm: LLM, adapters: dict[str, LoRARequest]) -> None:
    image = Image.new("RGB", (56, 56), (200, 30, 90))
    prompt = {
        "prompt": CHAT.format("<|vision_start|><|image_pad|><|vision_end|>What is it?"),
        "multi_modal_data": {"image": image},
    }
    llm.reset_prefix_cache()
    base, _ = _tokens(llm, prompt, None)
    llm.reset_prefix_cache()
    alone, _ = _tokens(llm, prompt, adapters["vision"])
    assert alone != base
    # One step encodes the image for both: each with its own tower.
    llm.reset_prefix_cache()
    outs = llm.generate([prompt, prompt], GREEDY, lora_request=[adapters["vision"], None])
    assert [list(o.outputs[0].token_ids) for o in outs] == [alone, base]


def test_only_a_vision_adapter_keys_image_embeddings_apart(adapters: dict[str, LoRARequest]) -> None:
    from vlmserve.multimodal.inputs import MultiModalItem

    item = MultiModalItem("image", 1, 4, (1, 4, 4), "abc", torch.zeros(16, 8), (56, 56), (56, 56))
    prompt = ProcessedPrompt([1, 2, 3, 4, 5, 6], [item], None, 0)

    def request(lora: tuple[LoRARequest, str, bool] | None) -> Request:
        return Request("r", prompt, SamplingParams(max_tokens=1), frozenset(), 64, lora=lora)

    base = request(None)
    language_only = request((adapters["lm"], "lm#1", False))
    vision = request((adapters["vision"], "vision#2", True))
    assert language_only.mm_items[0].content_hash == base.mm_items[0].content_hash == "abc"
    assert vision.mm_items[0].content_hash not in ("abc", language_only.mm_items[0].content_hash)
    assert len({base.cache_salt, language_only.cache_salt, vision.cache_salt}) == 3


def test_the_engines_adapters(llm: LLM, adapters: dict[str, LoRARequest], tmp_path: Path) -> None:
    engine = llm.llm_engine
    lm = adapters["lm"]
    engine.add_lora(lm)
    engine.add_lora(lm)  # the same name and path again: nothing to do
    assert lm in engine.list_loras()
    with pytest.raises(LoRAError, match="'lm' is loaded already from .* unload it first"):
        engine.add_lora(LoRARequest("lm", 1, adapters["vision"].lora_path))
    with pytest.raises(LoRAError, match="lora_int_id 1 is adapter 'lm'"):
        engine.add_lora(LoRARequest("other", 1, lm.lora_path))
    assert engine.remove_lora("lm") and not engine.remove_lora("lm")
    assert lm not in engine.list_loras()
    # Loaded again on first use, its tokens as before.
    prompt = CHAT.format("hello")
    first, _ = _tokens(llm, prompt, lm)
    assert engine.remove_lora("lm")
    assert _tokens(llm, prompt, lm)[0] == first


def test_each_row_keeps_its_own_slots_columns() -> None:
    cpu = torch.device("cpu")
    assert step_rows([-1, -1], cpu) is None
    uniform = step_rows([1, 1, 1], cpu)
    assert uniform is not None and uniform.slot_of_row is None and (uniform.first, uniform.last) == (1, 1)
    mixed = step_rows([0, -1, 2], cpu)
    assert mixed is not None and (mixed.first, mixed.last) == (0, 2)
    # Slots 0..2 of 2 columns each: row 0 slot 0's, row 1 none, row 2 slot 2's.
    expected = torch.tensor([[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1]], dtype=torch.float32)
    assert torch.equal(mixed.mask(2, torch.float32), expected)
