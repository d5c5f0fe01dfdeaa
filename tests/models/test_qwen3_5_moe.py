"""Qwen3.5-MoE (Qwen3.5's hybrid decoder with a routed mixture of experts plus a sigmoid-gated
shared expert in every layer) against transformers 5.23 on the same tiny checkpoint files, its
experts written one by one as published: config parsing, float32 logits through a chunked
prefill and decode steps, greedy tokens batched and alone, make-tiny, inspect's active
parameters, and the loader's per-expert checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.engine.test_preemption_multimodal import run
from tests.model_harness import Harness
from tests.models.test_qwen3_5 import IMAGE, chat, hf_inputs, image, make_engine
from tests.reference import hf_mm_greedy, hf_mm_logits
from vlmserve.families.qwen3_5.config import Qwen35FamilyConfig
from vlmserve.families.qwen3_5.tiny import MOE_SPEC, write_tiny_qwen3_5
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.processor.base import ImageInput
from vlmserve.registry import load_model_config, parse_model_config


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_5(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3.5-moe", MOE_SPEC)


@pytest.fixture(scope="module")
def hf_moe(moe_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import Qwen3_5MoeForConditionalGeneration

    return Qwen3_5MoeForConditionalGeneration.from_pretrained(str(moe_dir), dtype=torch.float32).eval()


@pytest.mark.parity
def test_tiny_config_reads_as_transformers_reads_it(moe_dir: Path) -> None:
    from transformers import AutoConfig

    ours, theirs = load_model_config(moe_dir / "config.json"), AutoConfig.from_pretrained(str(moe_dir))
    text = theirs.text_config
    family = ours.family_config
    assert isinstance(family, Qwen35FamilyConfig) and family.moe is not None
    assert ours.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert (family.moe.num_experts, family.moe.num_experts_per_tok) == (text.num_experts, text.num_experts_per_tok)
    assert family.moe.moe_intermediate_size == text.moe_intermediate_size == 24
    assert family.shared_expert_intermediate_size == text.shared_expert_intermediate_size == 40
    assert all(family.moe.is_sparse(layer) for layer in range(ours.text.num_hidden_layers))
    assert list(family.layer_types) == text.layer_types


def test_a_config_without_experts_says_so(moe_dir: Path) -> None:
    raw = json.loads((moe_dir / "config.json").read_text())
    del raw["text_config"]["num_experts"]
    with pytest.raises(ValueError, match="num_experts"):
        parse_model_config(raw)
    raw = json.loads((moe_dir / "config.json").read_text())
    raw["text_config"]["num_experts_per_tok"] = 7
    with pytest.raises(ValueError, match=r"num_experts_per_tok 7 must be in 1..num_experts \(6\)"):
        parse_model_config(raw)


CASES = {
    "one image": (chat(IMAGE, "What is this?"), [(14, 20, 1)]),
    "text only": (chat("Tell me a story about a lighthouse that stands alone by a grey and restless sea."), []),
}


@pytest.mark.parity
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_and_decode_logits_match_transformers_float32(  # type: ignore[no-untyped-def]
    case: str, moe_dir: Path, hf_moe
) -> None:
    text, sizes = CASES[case]
    pictures = [image(*size) for size in sizes]
    prompt = make_engine(moe_dir).processor.process(text, [ImageInput(p) for p in pictures])
    ids, vision = hf_inputs(moe_dir, text, pictures)
    assert ids == prompt.prompt_token_ids
    extra = [1234, 77, 151645, 9]
    reference = hf_mm_logits(hf_moe, ids + extra, vision)
    n = prompt.num_tokens
    ours = Harness(moe_dir, torch.float32).logits(
        prompt, chunks=[n // 3, n // 2 - n // 3 + 5, n - n // 2 - 5], extra=extra
    )
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max().item() < 1e-4


GREEDY_CASES = [
    (chat(IMAGE, "What is in this image?"), [(14, 20, 8)]),
    (chat("Write a haiku about the sea."), []),
    (chat(IMAGE, IMAGE, "Which is darker?"), [(16, 16, 9), (22, 14, 10)]),
]


@pytest.mark.slow
@pytest.mark.parity
def test_greedy_batched_and_alone_match_transformers_generate(moe_dir: Path, hf_moe) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(moe_dir)
    prompts: dict[str, ProcessedPrompt] = {}
    expected = {}
    for i, (text, sizes) in enumerate(GREEDY_CASES):
        pictures = [image(*size) for size in sizes]
        prompts[f"p{i}"] = engine.processor.process(text, [ImageInput(p) for p in pictures])
        ids, vision = hf_inputs(moe_dir, text, pictures)
        expected[f"p{i}"] = hf_mm_greedy(hf_moe, ids, vision, 8)
    batched = run(engine, prompts, 8)
    assert {k: o.outputs[0].token_ids for k, o in batched.items()} == expected
    for key, prompt in prompts.items():
        assert run(engine, {key: prompt}, 8)[key].outputs[0].token_ids == expected[key]


@pytest.mark.parity
def test_a_checkpoint_saved_by_transformers_gives_its_greedy_tokens(moe_dir: Path, hf_moe, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """What the installed transformers' save_pretrained writes (5.23 and 5.24: experts one by one
    under the published names, num_experts as it is) loads and gives transformers' tokens."""
    import shutil

    import transformers

    from vlmserve.model_files import read_json, weight_names

    saved = tmp_path / "saved"
    hf_moe.save_pretrained(str(saved))
    for name in moe_dir.iterdir():
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
    assert run(engine, {"p": prompt}, 8)["p"].outputs[0].token_ids == hf_mm_greedy(hf_moe, ids, vision, 8)


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


def test_a_checkpoint_missing_one_expert_or_with_one_too_many_is_refused(moe_dir: Path) -> None:
    from safetensors.torch import load_file

    from vlmserve.attention import TorchAttentionBackend
    from vlmserve.families.qwen3_5.model import Qwen35MoeForConditionalGeneration

    config = load_model_config(moe_dir / "config.json")
    weights = load_file(str(moe_dir / "model.safetensors"))
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
