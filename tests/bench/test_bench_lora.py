"""The LoRA benchmark: its hand-written adapters are what PEFT itself loads, and a run on a tiny
checkpoint prints both workloads' rates and the adapter's memory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.lora_adapters import peft_model
from vlmserve.bench.lora import main, write_lora_adapter


@pytest.mark.parametrize("model_dir", ["tiny_dir", "tiny3_dir"])
def test_adapter_files_are_what_peft_loads(model_dir: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Qwen2-VL's checkpoint names its layers model.layers.N (transformers 4), Qwen3-VL's
    model.language_model.layers.N: both give PEFT's names, and PEFT puts every tensor in place."""
    checkpoint = request.getfixturevalue(model_dir)
    folder = write_lora_adapter(checkpoint, tmp_path / "adapter", rank=4, seed=0, alpha=8)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    peft = peft_model(checkpoint, folder)
    loaded = {
        name: param for name, param in peft.named_parameters() if ".lora_A." in name or ".lora_B." in name
    }  # PEFT names them <module>.lora_A.default.weight
    assert {name.replace(".default.", ".") for name in loaded} == set(weights)
    for name, param in loaded.items():
        assert torch.equal(param, weights[name.replace(".default.", ".")]), name
    layers = peft.base_model.model.config.get_text_config().num_hidden_layers
    assert len(weights) == layers * 7 * 2  # q, k, v, o, gate, up, down: A and B each
    assert next(iter(peft.peft_config.values())).lora_alpha == 8


def test_benchmark_prints_both_workloads_and_the_adapter_memory(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["--adapters", "2", "--rank", "4", "--requests", "3", "--max-tokens", "3", "--rounds", "2"]
    assert main([str(tiny_dir), "--dtype", "float32", *args]) == 0
    out = capsys.readouterr().out
    rates = {
        name: [float(r) for r in rounds.split(", ")]
        for name, rounds in re.findall(r"(base model|2 adapters) .* tokens/s +\(rounds: ([\d., ]+)\)", out)
    }
    assert set(rates) == {"base model", "2 adapters"} and all(len(r) == 2 and min(r) > 0 for r in rates.values())
    mib = float(re.search(r"adapter memory +([\d.]+) MiB each read", out)[1])  # type: ignore[index]
    # Every A and B element of one adapter at float32's 4 bytes.
    adapter = write_lora_adapter(tiny_dir, tmp_path / "adapter", rank=4, seed=0)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    assert mib == pytest.approx(4 * sum(t.numel() for t in weights.values()) / (1 << 20), abs=0.005)
    # A slot holds at least the adapter (fused layers' slots are as wide as all their parts).
    slot = float(re.search(r"slot memory +([\d.]+) MiB each, 2 slots", out)[1])  # type: ignore[index]
    assert slot >= mib > 0
