"""LoRA on the families transformers + PEFT cannot check here: Qwen-VL-Chat (remote code only) and
Qwen3.5's linear-attention layers (their projections fused differently from the checkpoint's).
An adapter on every linear layer of the language model must give what its update merged into the
checkpoint's weights gives (W + scaling * B @ A, PEFT's merge_and_unload): the same greedy tokens,
logprobs within float32 rounding."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vlmserve import LLM, SamplingParams
from vlmserve.lora import LoRARequest

GREEDY = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
PROMPT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
# Each family's language-model linear layers, as its checkpoint names them (PEFT's target names).
TARGETS = {
    "tiny_qwen_vl_dir": r"transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.w1|mlp\.w2|mlp\.c_proj)",
    "tiny35_dir": r"model\.language_model\.layers\.\d+\."
    r"(linear_attn\.(in_proj_\w+|out_proj)|self_attn\.[qkvo]_proj|mlp\.\w+_proj)",
}
RANK, ALPHA = 4, 8


def write_adapter_and_merged(model_dir: Path, pattern: str, folder: Path, merged: Path) -> None:
    """A rank-4 adapter on every checkpoint weight the pattern names (PEFT's layout and tensor
    names), and a copy of the checkpoint with the adapter's update merged into those weights."""
    generator = torch.Generator().manual_seed(0)
    merged.mkdir()
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":
            (merged / path.name).symlink_to(path)
    adapter: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        for name, weight in tensors.items():
            module = name.removesuffix(".weight")
            if not re.fullmatch(pattern, module):
                continue
            out_features, in_features = weight.shape
            scale = (0.5 * float(weight.float().std()) * RANK**-0.5 / (ALPHA / RANK)) ** 0.5
            a = torch.randn(RANK, in_features, generator=generator) * scale
            b = torch.randn(out_features, RANK, generator=generator) * scale
            adapter[f"base_model.model.{module}.lora_A.weight"] = a
            adapter[f"base_model.model.{module}.lora_B.weight"] = b
            # Kept in float32 (a bf16 checkpoint's merged weight rounded back would differ by ~1e-2).
            tensors[name] = weight.float() + (ALPHA / RANK) * b @ a
            modules.append(module)
        save_file(tensors, str(merged / path.name), metadata={"format": "pt"})
    assert modules, f"no weight of {model_dir.name} matches {pattern}"
    folder.mkdir()
    save_file(adapter, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": sorted(modules), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("fixture", list(TARGETS))
def test_an_adapter_gives_its_merged_weights_tokens(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    write_adapter_and_merged(model_dir, TARGETS[fixture], tmp_path / "adapter", tmp_path / "merged")
    small = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_gib": 0.01}
    merged = LLM(tmp_path / "merged", **small).generate(PROMPT, GREEDY)[0].outputs[0]
    llm = LLM(model_dir, enable_lora=True, max_lora_rank=RANK, **small)
    base = llm.generate(PROMPT, GREEDY)[0].outputs[0]
    adapted = llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")))[0].outputs[0]
    assert adapted.token_ids != base.token_ids, "the adapter must change the tokens for this test to mean anything"
    assert adapted.token_ids == merged.token_ids
    assert adapted.logprobs is not None and merged.logprobs is not None
    for mine, theirs in zip(adapted.logprobs, merged.logprobs, strict=True):
        for token, logprob in theirs.items():
            assert abs(mine[token].logprob - logprob.logprob) < 1e-4


def test_an_adapter_on_an_embedding_model_gives_its_merged_weights_embeddings(
    embedding_dir: Path, tmp_path: Path
) -> None:
    """A pooling model (Qwen3-VL-Embedding's layout) with an adapter on its language model: the
    embeddings of its update merged into the weights, a batch of an adapter's and the base's
    inputs included."""
    from PIL import Image

    pattern = r"model\.language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.\w+_proj)"
    write_adapter_and_merged(embedding_dir, pattern, tmp_path / "adapter", tmp_path / "merged")
    small = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_gib": 0.01}
    inputs = [{"text": "a red square"}, {"text": "a picture", "image": Image.new("RGB", (64, 64), "red")}]
    merged = torch.tensor([o.outputs.embedding for o in LLM(tmp_path / "merged", **small).embed(inputs)])
    llm = LLM(embedding_dir, enable_lora=True, max_lora_rank=RANK, **small)
    adapter = LoRARequest("a", 1, str(tmp_path / "adapter"))
    base = torch.tensor([o.outputs.embedding for o in llm.embed(inputs)])
    mixed = llm.embed(inputs + inputs, lora_request=[adapter, adapter, None, None])
    adapted = torch.tensor([o.outputs.embedding for o in mixed])
    assert float((base - merged).abs().max()) > 1e-2, (
        "the adapter must move the embeddings for this test to mean anything"
    )
    torch.testing.assert_close(adapted[:2], merged, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(adapted[2:], base, atol=1e-5, rtol=1e-4)
