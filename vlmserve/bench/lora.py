"""LoRA adapters end to end: the same requests through one offline engine with LoRA enabled, on
the base model alone and spread over several random adapters, in alternating rounds, each
request sampled with the checkpoint's own defaults (generation_config.json); per workload the
generated tokens per second and their ratio, and the memory one adapter takes in the engine.

    python -m vlmserve.bench.lora DIR [--adapters 4] [--rank 16] [--requests 32]
        [--max-tokens 64] [--rounds 3] [--dtype auto]

The adapters are written in PEFT's layout (adapter_config.json, adapter_model.safetensors under
PEFT's tensor names) with random A and B on every attention and MLP projection of the language
model that the checkpoint has (Qwen3.5's linear-attention layers have no q/k/v/o_proj: those are
left out), into a temporary folder."""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vlmserve.bench.speculative import PROMPTS  # the same short prompts: decode dominates
from vlmserve.model_files import safetensors_files

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# A language-model projection's weight in the checkpoint, under either layout: transformers 4's
# model.layers.N... (Qwen2-VL, Qwen2.5-VL) or transformers 5's model.language_model.layers.N...
_PROJECTION = re.compile(
    r"^model\.(?:language_model\.)?layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight$"
)


def projection_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """The language model's attention and MLP projections the checkpoint holds: PEFT's module
    name (transformers 5's, under PeftModel's base_model.model) -> the weight's [out_features,
    in_features], read from the safetensors headers."""
    shapes: dict[str, tuple[int, int]] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if m := _PROJECTION.match(name):
                    out_features, in_features = f.get_slice(name).get_shape()
                    shapes[f"base_model.model.model.language_model.layers.{m[1]}.{m[2]}"] = (out_features, in_features)
    return shapes


def write_lora_adapter(model_dir: Path, folder: Path, rank: int, seed: int, alpha: int | None = None) -> Path:
    """A random rank-`rank` LoRA adapter on every language-model projection of the checkpoint in
    `model_dir`, in PEFT's files: adapter_config.json and adapter_model.safetensors holding
    `<module>.lora_A.weight` [rank, in_features] and `<module>.lora_B.weight` [out_features, rank]
    in float32. lora_alpha defaults to the rank (scaling 1). Returns `folder`."""
    shapes = projection_shapes(model_dir)
    if not shapes:
        raise ValueError(f"{model_dir}: no language-model attention or MLP projection weights found")
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for module, (out_features, in_features) in sorted(shapes.items()):
        # Small enough that the adapted model stays a language model, large enough to change it.
        tensors[f"{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
        tensors[f"{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.1 / rank**0.5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": rank if alpha is None else alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted({m.rsplit(".", 1)[1] for m in shapes}),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vlmserve.bench.lora", description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="a checkpoint directory")
    p.add_argument("--adapters", type=int, default=4, help="adapters the LoRA workload spreads its requests over")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=32, help="requests decoded together")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)

    from vlmserve import LLM
    from vlmserve.lora import LoRARequest

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_model_len=4096,
        max_num_seqs=max(8, args.requests),
        enable_lora=True,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
    )
    params = llm.get_default_sampling_params()
    params = replace(params, max_tokens=args.max_tokens, ignore_eos=True)
    deterministic = params.takes_argmax
    prompts = [PROMPTS[i % len(PROMPTS)] + (f" ({i})" if i >= len(PROMPTS) else "") for i in range(args.requests)]
    per_request = [params if deterministic else replace(params, seed=1000 + i) for i in range(args.requests)]
    print(
        f"sampling: temperature {params.temperature}, top_k {params.top_k}, top_p {params.top_p}, "
        f"repetition_penalty {params.repetition_penalty} (the checkpoint's)"
    )
    with tempfile.TemporaryDirectory(prefix="vlmserve-lora-bench-") as folder:
        adapters = [
            LoRARequest(
                f"adapter-{i}",
                i + 1,
                str(write_lora_adapter(args.model, Path(folder) / f"adapter-{i}", args.rank, seed=i)),
            )
            for i in range(args.adapters)
        ]
        workloads: dict[str, list[Any]] = {
            "base": [None] * args.requests,
            "lora": [adapters[i % len(adapters)] for i in range(args.requests)],
        }
        # warm up: the kernels' first calls, the allocator, each adapter loaded into the pool
        llm.generate(prompts[:1], replace(params, max_tokens=4))
        llm.generate(
            prompts[: len(adapters)], replace(params, max_tokens=4), lora_request=workloads["lora"][: len(adapters)]
        )
        rates: dict[str, list[float]] = {name: [] for name in workloads}
        for _ in range(args.rounds):
            for name, loras in workloads.items():
                start = time.perf_counter()
                done = llm.generate(prompts, per_request, lora_request=loras)
                elapsed = time.perf_counter() - start
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in done) / elapsed)
    # What the engine holds of each adapter read (on each tensor-parallel rank): its A and B in the
    # model's dtype; and what one of the max_loras slots takes on the device, on every layer an
    # adapter changes, at max_lora_rank (in this process only: not with tensor parallelism).
    held = [llm.llm_engine.core.loras[adapter.lora_name][1] for adapter in adapters]
    runner = getattr(llm.llm_engine.core.executor, "runner", None)
    slots = runner.lora if runner is not None else None
    base, lora = statistics.median(rates["base"]), statistics.median(rates["lora"])
    print(f"{args.requests} requests x {args.max_tokens} tokens, {args.rounds} rounds, median:")
    for label, name, rate in (("base model", "base", base), (f"{args.adapters} adapters", "lora", lora)):
        rounds = ", ".join(f"{r:.1f}" for r in rates[name])
        print(f"  {label:<16} {rate:8.1f} tokens/s  (rounds: {rounds})")
    print(f"  ratio            {lora / base:8.2f}x")
    print(
        f"  adapter memory   {max(info.nbytes for info in held) / (1 << 20):8.2f} MiB each read "
        f"(rank {args.rank}, {held[0].num_layers} layers)"
    )
    if slots is not None:
        slot_bytes = sum(layer.nbytes for layer in slots.layers.values()) // slots.max_loras
        print(f"  slot memory      {slot_bytes / (1 << 20):8.2f} MiB each, {slots.max_loras} slots on the device")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
