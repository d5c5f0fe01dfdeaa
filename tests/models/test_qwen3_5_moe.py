"""Qwen3.5-MoE (Qwen3.5's hybrid decoder with a routed mixture of experts plus a sigmoid-gated
shared expert in every layer) against transformers 5.23 on the same tiny checkpoint files, its
experts written one by one as published: config parsing, a checkpoint transformers saved,
make-tiny, inspect's active parameters, and the loader's per-expert checks. Float32 logits
through a chunked prefill and decode steps, and greedy tokens batched, alone and cached, are the
families' conformance suite's (tests/families)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.engine.test_preemption_multimodal import run
from tests.model_harness import Harness
from tests.models.test_qwen3_5 import IMAGE, chat, hf_inputs, image, make_engine
from tests.reference import hf_mm_greedy
from vlmserve.families.qwen3_5.config import Qwen35FamilyConfig
from vlmserve.processor.base import ImageInput
from vlmserve.registry import load_model_config, parse_model_config


@pytest.mark.parity
def test_tiny_config_reads_as_transformers_reads_it(tiny35_moe_dir: Path) -> None:
    from transformers import AutoConfig

    ours, theirs = load_model_config(tiny35_moe_dir / "config.json"), AutoConfig.from_pretrained(str(tiny35_moe_dir))
    text = theirs.text_config
    family = ours.family_config
    assert isinstance(family, Qwen35FamilyConfig) and family.moe is not None
    assert ours.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert (family.moe.num_experts, family.moe.num_experts_per_tok) == (text.num_experts, text.num_experts_per_tok)
    assert family.moe.moe_intermediate_size == text.moe_intermediate_size == 24
    assert family.shared_expert_intermediate_size == text.shared_expert_intermediate_size == 40
    assert all(family.moe.is_sparse(layer) for layer in range(ours.text.num_hidden_layers))
    assert list(family.layer_types) == text.layer_types


def test_a_config_without_experts_says_so(tiny35_moe_dir: Path) -> None:
    raw = json.loads((tiny35_moe_dir / "config.json").read_text())
    del raw["text_config"]["num_experts"]
    with pytest.raises(ValueError, match="num_experts"):
        parse_model_config(raw)
    raw = json.loads((tiny35_moe_dir / "config.json").read_text())
    raw["text_config"]["num_experts_per_tok"] = 7
    with pytest.raises(ValueError, match=r"num_experts_per_tok 7 must be in 1..num_experts \(6\)"):
        parse_model_config(raw)


GREEDY_CASES = [
    (chat(IMAGE, "What is in this image?"), [(14, 20, 8)]),
    (chat("Write a haiku about the sea."), []),
    (chat(IMAGE, IMAGE, "Which is darker?"), [(16, 16, 9), (22, 14, 10)]),
]


@pytest.mark.slow
@pytest.mark.parity
def test_a_checkpoint_saved_by_transformers_gives_its_greedy_tokens(
    tiny35_moe_dir: Path, hf35_moe_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """What the installed transformers' save_pretrained writes (5.23 and 5.24: experts one by one
    under the published names, num_experts as it is) loads and gives transformers' tokens."""
    import shutil

    import transformers

    from vlmserve.model_files import read_json, weight_names

    saved = tmp_path / "saved"
    hf35_moe_model.save_pretrained(str(saved))
    for name in tiny35_moe_dir.iterdir():
        if not (saved / name.name).exists() and not name.name.startswith("model"):
            shutil.copy(name, saved / name.name)  # the tokenizer and processor files it does not write
    config = read_json(saved / "config.json")
    assert config["transformers_version"] == transformers.__version__ and config["text_config"]["num_experts"] == 6
    names = set(weight_names(saved) or [])
    layer = "model.language_model.layers.3.mlp."
    assert {layer + f"experts.5.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")} <= names
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in names)
    engine = make_engine(saved)
    text, sizes = GREEDY_CASES[0]
    pictures = [image(*size) for size in sizes]
    ids, vision = hf_inputs(saved, text, pictures)
    prompt = engine.processor.process(text, [ImageInput(p) for p in pictures])
    assert run(engine, {"p": prompt}, 8)["p"].outputs[0].token_ids == hf_mm_greedy(hf35_moe_model, ids, vision, 8)


def test_make_tiny_writes_experts_one_by_one_as_published(tmp_path: Path) -> None:
    from vlmserve.entrypoints.cli import main

    out = tmp_path / "q35moe"
    assert main(["make-tiny", "--arch", "qwen3_5_moe", "--shards", "2", str(out)]) == 0
    assert load_model_config(out / "config.json").architecture == "Qwen3_5MoeForConditionalGeneration"
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    layer = "model.language_model.layers.3.mlp."
    assert {layer + f"experts.5.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")} <= set(names)
    assert {layer + "gate.weight", layer + "shared_expert_gate.weight", layer + "shared_expert.up_proj.weight"} <= set(
        names
    )
    assert not any(name.endswith("experts.gate_up_proj") for name in names)
    Harness(out)  # every published name loads, and no parameter is left unloaded


def test_a_checkpoint_missing_one_expert_or_with_one_too_many_is_refused(tiny35_moe_dir: Path) -> None:
    from safetensors.torch import load_file

    from vlmserve.attention import TorchAttentionBackend
    from vlmserve.families.qwen3_5.model import Qwen35MoeForConditionalGeneration

    config = load_model_config(tiny35_moe_dir / "config.json")
    weights = load_file(str(tiny35_moe_dir / "model.safetensors"))
    model = Qwen35MoeForConditionalGeneration(config, TorchAttentionBackend())
    model.tie_weights()
    missing = {k: v for k, v in weights.items() if k != "model.language_model.layers.2.mlp.experts.4.up_proj.weight"}
    with pytest.raises(ValueError, match=r"lacks weights: \['model.layers.2.mlp.experts.gate_up_proj#4#up'\]"):
        model.load_weights(missing.items())
    extra = weights | {"model.language_model.layers.2.mlp.experts.6.down_proj.weight": torch.zeros(64, 24)}
    with pytest.raises(ValueError, match="experts.6.down_proj.weight: expert 6, the model has 6 experts"):
        model.load_weights(extra.items())


@pytest.mark.parity
def test_inspect_counts_the_parameters_a_token_uses() -> None:
    """transformers' default Qwen3.5-MoE (the 35B-A3B shape: 40 layers of 256 experts, 8 per
    token, 512 wide, and a shared expert): the total is transformers' own count, and a token
    leaves 248 of 256 experts unused in each layer."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    from vlmserve.inspect import format_report, inspect_config

    hf_config = Qwen3_5MoeConfig(vision_config={"out_hidden_size": 2048})
    with torch.device("meta"):
        hf_total = sum(p.numel() for p in Qwen3_5MoeForConditionalGeneration(hf_config).parameters())
    report = inspect_config(parse_model_config(hf_config.to_dict()), torch.bfloat16)
    assert report.total == hf_total
    unused_per_layer = (256 - 8) * 3 * 512 * 2048
    assert report.active == report.total - 40 * unused_per_layer
    assert f"  {'active per token (routed experts)':<40} {report.active:>16,}" in format_report(report)
