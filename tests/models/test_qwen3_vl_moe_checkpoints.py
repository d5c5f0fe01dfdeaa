"""Qwen3-VL-MoE checkpoints in the two layouts they come in: as published (experts stacked
[experts, in, out], `num_experts`) and as transformers 5's save_pretrained writes them ([experts,
out, in], `num_local_experts`, its transformers_version). The second is made here from the first
by transposition, and, marked `parity`, written by the installed transformers itself (CI runs
those tests against the newest release too)."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.model_harness import Harness
from tests.models.test_parallel import build_rank
from tests.models.test_qwen3_vl import GREEDY_CASES, IMAGE, MAX_NEW, chat, hf_inputs, image, process
from tests.reference import hf_mm_greedy
from vlmserve.families.qwen3_vl.tiny import (
    MOE_SPEC,
    TinySpec,
    config_json,
    random_weights,
    write_qwen3_vl_files,
    write_tiny_qwen3_vl,
)
from vlmserve.model_files import iterate_weights, read_json, safetensors_files, weight_names
from vlmserve.registry import load_model_config

STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def as_transformers_5_saves_it(
    published: Path, out: Path, transformers_version: str | None = "5.24.0", keep: tuple[str, ...] = ()
) -> Path:
    """A copy of `published` as transformers 5 writes it: every stacked expert tensor but those
    named in `keep` transposed to [experts, out, in], num_experts written as num_local_experts, and
    `transformers_version` (None: left out)."""
    config = read_json(published / "config.json")
    text = dict(config["text_config"])
    text["num_local_experts"] = text.pop("num_experts")
    config["text_config"] = text
    if transformers_version is not None:
        config["transformers_version"] = transformers_version
    weights = {
        name: t.transpose(1, 2).contiguous() if name.endswith(STACKED) and name not in keep else t
        for name, t in iterate_weights(published)
    }
    return write_qwen3_vl_files(out, config, weights, {"from": str(published)})


def stored_shape(model_dir: Path, name: str) -> tuple[int, ...]:
    """The shape checkpoint tensor `name` is stored in, from the safetensors headers."""
    for file in safetensors_files(model_dir):
        with safe_open(str(file), "pt") as f:
            if name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                return tuple(f.get_slice(name).get_shape())
    raise KeyError(name)


def prompt_logits(model_dir: Path) -> torch.Tensor:
    """Logits of a two-image prompt prefilled in two chunks, then three decode steps."""
    text = chat(IMAGE, "and", IMAGE, "compare them")
    prompt = process(model_dir, text, [image(16, 16, 2), image(22, 14, 3)])
    return Harness(model_dir).logits(prompt, chunks=[40, prompt.num_tokens - 40], extra=[1234, 77, 9])


def test_experts_stored_out_in_give_the_published_layout_s_logits(tiny3_moe_dir: Path, tmp_path: Path) -> None:
    saved = as_transformers_5_saves_it(tiny3_moe_dir, tmp_path / "saved")
    name = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    # [experts, hidden, 2 * moe_intermediate] as published, the other way round as saved
    assert (stored_shape(tiny3_moe_dir, name), stored_shape(saved, name)) == ((8, 64, 48), (8, 48, 64))
    config = load_model_config(saved / "config.json")
    assert config.family_config.moe.num_experts == 8 and config.transformers_version == "5.24.0"
    published = prompt_logits(tiny3_moe_dir)
    assert torch.equal(prompt_logits(saved), published)
    assert published.argmax(-1).unique().numel() > 3  # the logits are not all alike


SQUARE_SPEC = replace(MOE_SPEC, moe_intermediate_size=32)  # gate_up_proj [experts, 64, 64]: square


@pytest.fixture(scope="module")
def square_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_vl(tmp_path_factory.mktemp("ckpt") / "square", SQUARE_SPEC, seed=2)


def _gate_up(model_dir: Path) -> torch.Tensor:
    """Layer 0's stacked gate_up_proj as vlmserve loaded it: [experts, 2 * intermediate, hidden]."""
    return Harness(model_dir).model.model.layers[0].mlp.experts.gate_up_proj.data


def test_a_square_gate_up_proj_is_oriented_by_down_proj_s_shape(square_dir: Path, tmp_path: Path) -> None:
    published = dict(iterate_weights(square_dir))["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert published.shape == (8, 64, 64) and not torch.equal(published, published.transpose(1, 2))
    saved = as_transformers_5_saves_it(square_dir, tmp_path / "saved", transformers_version=None)
    expected = published.transpose(1, 2).float()
    assert torch.equal(_gate_up(square_dir), expected) and torch.equal(_gate_up(saved), expected)
    assert torch.equal(prompt_logits(saved), prompt_logits(square_dir))


def test_a_square_gate_up_proj_nothing_orients_is_refused_until_the_version_says(
    square_dir: Path, tmp_path: Path
) -> None:
    """Layer 2's down_proj left as published and layer 0's transposed: the shapes disagree, so
    only config.json's transformers_version can say which way the square tensors are."""
    keep = ("model.language_model.layers.2.mlp.experts.down_proj",)
    mixed = as_transformers_5_saves_it(square_dir, tmp_path / "mixed", transformers_version=None, keep=keep)
    with pytest.raises(ValueError) as error:
        Harness(mixed)
    message = str(error.value)
    assert message.startswith(
        f"checkpoint {mixed}: "  # the folder, then the weight
        "weight model.language_model.layers.0.mlp.experts.gate_up_proj: checkpoint shape (8, 64, 64) fits both "
        "(8, 64, 64) [experts, out, in] (transformers 5's save_pretrained) and (8, 64, 64) [experts, in, out]"
    )
    assert "its other stacked expert tensors are stored both ways" in message
    assert message.endswith(
        'Set "transformers_version" in config.json to the release that wrote the checkpoint '
        "(4.x: [experts, in, out], 5.x: [experts, out, in])"
    )
    config = read_json(mixed / "config.json")
    (mixed / "config.json").write_text(json.dumps({**config, "transformers_version": "5.24.0"}))
    published = dict(iterate_weights(square_dir))["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(_gate_up(mixed), published.transpose(1, 2).float())


@pytest.mark.parametrize("spec", [MOE_SPEC, SQUARE_SPEC], ids=["moe", "square gate_up_proj"])
def test_each_rank_takes_the_same_expert_slices_from_either_layout(spec: TinySpec) -> None:
    """tensor_parallel_size 2 (simulated in process): each rank's half of the intermediate
    dimension of every expert, from the published tensors and from their transposes."""
    published_raw, published = config_json(spec), random_weights(spec)
    saved_raw = copy.deepcopy(published_raw)
    saved_raw["text_config"]["num_local_experts"] = saved_raw["text_config"].pop("num_experts")  # type: ignore[index, union-attr]
    saved = {name: t.transpose(1, 2) if name.endswith(STACKED) else t for name, t in published.items()}
    half = spec.moe_intermediate_size // 2
    for rank in range(2):
        ours = [
            build_rank(raw, rank, 2, weights).model.layers[0].mlp.experts
            for raw, weights in ((published_raw, published), (saved_raw, saved))
        ]
        gate_up = published["model.language_model.layers.0.mlp.experts.gate_up_proj"].transpose(1, 2).float()
        rows = [*range(rank * half, (rank + 1) * half), *range(2 * half + rank * half, 2 * half + (rank + 1) * half)]
        down = published["model.language_model.layers.0.mlp.experts.down_proj"].transpose(1, 2).float()
        for experts in ours:
            assert torch.equal(experts.gate_up_proj.data, gate_up[:, rows])  # [experts, gate | up (rank's), hidden]
            assert torch.equal(experts.down_proj.data, down[:, :, rank * half : (rank + 1) * half])


# -- written by transformers' save_pretrained ----------------------------------------------------


@pytest.fixture(scope="module")
def saved_by_transformers(tiny3_moe_dir: Path, hf3_moe_model, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    """The tiny checkpoint as transformers read it, written back by its save_pretrained (config,
    generation config, weights), beside the tokenizer and processor files it does not write."""
    out = tmp_path_factory.mktemp("ckpt") / "saved-by-transformers"
    hf3_moe_model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.json", "preprocessor_config.json"):
        shutil.copy(tiny3_moe_dir / name, out / name)
    shutil.copy(tiny3_moe_dir / "video_preprocessor_config.json", out / "video_preprocessor_config.json")
    return out


@pytest.mark.parity
def test_what_transformers_save_pretrained_writes(saved_by_transformers: Path) -> None:
    """What docs/compatibility.md says transformers 5 writes for Qwen3-VL-MoE: num_local_experts,
    its version, and the stacked experts [experts, out, in] under the published names."""
    import transformers

    config = read_json(saved_by_transformers / "config.json")
    assert config["transformers_version"] == transformers.__version__
    assert config["text_config"]["num_local_experts"] == 8 and "num_experts" not in config["text_config"]
    names = weight_names(saved_by_transformers) or []
    p = "model.language_model.layers."
    expected = {f"{p}{layer}.{STACKED[0]}": (8, 48, 64) for layer in (0, 2)}  # sparse layers 0 and 2
    expected |= {f"{p}{layer}.{STACKED[1]}": (8, 64, 24) for layer in (0, 2)}
    assert {name: stored_shape(saved_by_transformers, name) for name in names if ".experts." in name} == expected


@pytest.mark.parity
def test_a_checkpoint_saved_by_transformers_gives_its_greedy_tokens(saved_by_transformers: Path, hf3_moe_model) -> None:  # type: ignore[no-untyped-def]
    from vlmserve import LLM, SamplingParams

    llm = LLM(
        saved_by_transformers,
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=96,
        kv_cache_memory_gib=0.02,
        limit_mm_per_prompt={"image": 2},
    )
    prompts, expected = [], []
    for text, sizes in GREEDY_CASES:
        pictures = [image(*size) for size in sizes]
        prompts.append(process(saved_by_transformers, text, pictures))
        ids, vision = hf_inputs(saved_by_transformers, text, pictures)
        assert ids == prompts[-1].prompt_token_ids
        expected.append(hf_mm_greedy(hf3_moe_model, ids, vision, MAX_NEW))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    assert [out.outputs[0].token_ids for out in llm._run(prompts, [params] * len(prompts))] == expected
