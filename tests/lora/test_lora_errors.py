"""Adapters the offline LLM cannot serve: each raises LoRAError naming what is wrong, before any
request of the call runs, and the LLM goes on serving the base model and good adapters."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.lora_adapters import LANGUAGE_MODEL, VISION_TOWER, write_adapter
from vlmserve import LLM, SamplingParams
from vlmserve.lora import LoRAError, LoRARequest

PROMPT = "<|im_start|>user\nTell me about lighthouses.<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(temperature=0, max_tokens=6)
Q_PROJ = "base_model.model.model.language_model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def good(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-8 adapter on Qwen2-VL's language model."""
    return write_adapter(tiny_dir, tmp_path_factory.mktemp("lora") / "good", 8, 16, LANGUAGE_MODEL, seed=0)


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> Iterator[LLM]:
    llm = LLM(
        tiny_dir, dtype="float32", max_model_len=512, kv_cache_memory_gib=0.02, enable_lora=True, max_lora_rank=16
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def expected(llm: LLM, good: Path) -> dict[str, list[int]]:
    """The base model's and the good adapter's tokens, before any bad adapter was tried."""
    outs = llm.generate([PROMPT, PROMPT], GREEDY, lora_request=[None, LoRARequest("good", 1, str(good))])
    tokens = {"base": list(outs[0].outputs[0].token_ids), "good": list(outs[1].outputs[0].token_ids)}
    assert tokens["base"] != tokens["good"]
    return tokens


def copy_adapter(good: Path, folder: Path) -> Path:
    shutil.copytree(good, folder)
    return folder


def edit_weights(folder: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = folder / "adapter_model.safetensors"
    weights = load_file(str(path))
    edit(weights)
    save_file(weights, str(path))


def renamed_module(folder: Path) -> None:
    """Layer 0's q_proj called `query` (a module no Qwen model has), in the weights and the config."""

    def rename(weights: dict) -> None:  # type: ignore[type-arg]
        for key in [k for k in weights if k.startswith(Q_PROJ + ".")]:
            weights[key.replace("self_attn.q_proj", "self_attn.query")] = weights.pop(key)

    edit_weights(folder, rename)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_modules"] = config["target_modules"].replace("q_proj|", "q_proj|query|")
    (folder / "adapter_config.json").write_text(json.dumps(config))


def wrong_lora_b_shape(folder: Path) -> None:
    def halve(weights: dict) -> None:  # type: ignore[type-arg]
        b = weights[Q_PROJ + ".lora_B.weight"]  # [out_features, r]
        weights[Q_PROJ + ".lora_B.weight"] = b[: b.shape[0] // 2].contiguous()

    edit_weights(folder, halve)


def no_weights_file(folder: Path) -> None:
    (folder / "adapter_model.safetensors").unlink()


def no_folder(folder: Path) -> None:
    shutil.rmtree(folder)


# name -> (how a copy of the good adapter is spoiled, what the message must name besides the
# adapter's folder)
SPOILED = {
    "module_the_model_lacks": (renamed_module, r"layers\.0\.self_attn\.query"),
    # the module, and lora_B's rows: half of q_proj's 64 outputs
    "lora_b_of_the_wrong_shape": (wrong_lora_b_shape, r"(?s)layers\.0\.self_attn\.q_proj.*\b32\b"),
    "missing_weights_file": (no_weights_file, r"adapter_model\.safetensors"),
    "missing_folder": (no_folder, r"(?i)no such|not exist|not found"),
}


def refusal(llm: LLM, good: Path, bad: LoRARequest) -> str:
    """The LoRAError of a call whose second prompt names the bad adapter (the good request ahead of
    it does not run either), its folder replaced by FOLDER: the message names it."""
    with pytest.raises(LoRAError) as refused:
        llm.generate([PROMPT, PROMPT], GREEDY, lora_request=[LoRARequest("good", 1, str(good)), bad])
    message = str(refused.value)
    assert bad.lora_path in message and repr(bad.lora_name) in message, message
    return message.replace(bad.lora_path, "FOLDER")


def assert_still_serving(llm: LLM, good: Path, expected: dict[str, list[int]]) -> None:
    # Nothing of the refused call was left queued or running.
    assert not llm.llm_engine.has_unfinished_requests()
    outs = llm.generate([PROMPT, PROMPT], GREEDY, lora_request=[LoRARequest("good", 1, str(good)), None])
    assert [list(o.outputs[0].token_ids) for o in outs] == [expected["good"], expected["base"]]
    assert [lora.lora_name for lora in llm.llm_engine.list_loras()] == ["good"]


@pytest.mark.parametrize("case", list(SPOILED))
def test_spoiled_adapter_is_named_and_the_llm_goes_on(
    llm: LLM, good: Path, expected: dict[str, list[int]], case: str, tmp_path: Path
) -> None:
    spoil, pattern = SPOILED[case]
    folder = copy_adapter(good, tmp_path / "adapter")
    spoil(folder)
    message = refusal(llm, good, LoRARequest("bad", 7, str(folder)))
    assert re.search(pattern, message), message
    assert_still_serving(llm, good, expected)


def test_rank_above_max_lora_rank(
    llm: LLM, good: Path, expected: dict[str, list[int]], tiny_dir: Path, tmp_path: Path
) -> None:
    folder = write_adapter(tiny_dir, tmp_path / "adapter", 32, 32, LANGUAGE_MODEL, seed=1)
    message = refusal(llm, good, LoRARequest("bad", 7, str(folder)))
    assert re.search(r"(?s)\b32\b.*max_lora_rank 16", message), message
    assert_still_serving(llm, good, expected)


def test_another_architectures_adapter(
    llm: LLM, good: Path, expected: dict[str, list[int]], tiny3_dir: Path, tmp_path: Path
) -> None:
    """A Qwen3-VL vision-tower adapter (its MLP layers linear_fc1/linear_fc2, its DeepStack mergers)
    on Qwen2-VL: its modules are named."""
    folder = write_adapter(tiny3_dir, tmp_path / "adapter", 8, 16, VISION_TOWER, seed=2)
    message = refusal(llm, good, LoRARequest("bad", 7, str(folder)))
    assert re.search(r"visual\.blocks\.0\.mlp\.linear_fc1|deepstack_merger_list", message), message
    assert_still_serving(llm, good, expected)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # PEFT's, on writing it
def test_modules_to_save_is_refused(
    llm: LLM, good: Path, expected: dict[str, list[int]], tiny_dir: Path, tmp_path: Path
) -> None:
    """An adapter that replaces whole modules (PEFT's modules_to_save) is more than a LoRA."""
    folder = write_adapter(tiny_dir, tmp_path / "adapter", 8, 16, LANGUAGE_MODEL, seed=3, modules_to_save=["lm_head"])
    message = refusal(llm, good, LoRARequest("bad", 7, str(folder)))
    assert "modules_to_save" in message and "lm_head" in message, message
    assert_still_serving(llm, good, expected)


# PEFT options whose adapters are more than A and B per layer: served as a plain LoRA they would
# answer wrongly, so each is refused by name.
UNSERVED_OPTIONS = {
    "use_dora": ({"use_dora": True}, r"use_dora"),  # DoRA: a learned magnitude per output
    "bias": ({"bias": "lora_only"}, r"bias"),  # trained biases of the adapted layers
}


@pytest.mark.parametrize("option", list(UNSERVED_OPTIONS))
def test_peft_options_not_served_are_named(
    llm: LLM, good: Path, expected: dict[str, list[int]], tiny_dir: Path, tmp_path: Path, option: str
) -> None:
    kwargs, pattern = UNSERVED_OPTIONS[option]
    folder = write_adapter(tiny_dir, tmp_path / "adapter", 8, 16, LANGUAGE_MODEL, seed=4, **kwargs)
    message = refusal(llm, good, LoRARequest("bad", 7, str(folder)))
    assert re.search(pattern, message), message
    assert_still_serving(llm, good, expected)


def test_same_name_another_path(llm: LLM, good: Path, expected: dict[str, list[int]], tmp_path: Path) -> None:
    other = copy_adapter(good, tmp_path / "other")
    llm.llm_engine.add_lora(LoRARequest("good", 1, str(good)))  # loaded already: nothing happens
    with pytest.raises(LoRAError) as refused:
        llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("good", 2, str(other)))
    assert "'good'" in str(refused.value) and str(good) in str(refused.value)  # where it is loaded from
    assert_still_serving(llm, good, expected)


def test_lora_request_with_lora_off(tiny_dir: Path, good: Path, expected: dict[str, list[int]]) -> None:
    llm = LLM(tiny_dir, dtype="float32", max_model_len=512, kv_cache_memory_gib=0.02)
    try:
        with pytest.raises(LoRAError, match="enable_lora"):
            llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("good", 1, str(good)))
        assert list(llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids) == expected["base"]
    finally:
        llm.shutdown()
