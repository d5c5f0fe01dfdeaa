"""Random LoRA adapters written by PEFT itself on the tiny checkpoints, and transformers + PEFT's
forward with one loaded: the reference vlmserve's LoRA is checked against.

Target modules are given as PEFT takes them: a list of module names (matched at the end of each
module's full name) or one regex string (matched against the whole name with re.fullmatch). The
transformers module names, as `model.named_modules()` lists them:

- language model (every family): model.language_model.layers.N.self_attn.{q,k,v,o}_proj and
  model.language_model.layers.N.mlp.{gate,up,down}_proj;
- every tower: the patch embedding model.visual.patch_embed.proj (a Conv3d, stride == kernel: PEFT
  writes lora_A [r, channels, t, p, p] and lora_B [out, r, 1, 1, 1]);
- Qwen2-VL tower: model.visual.blocks.N.attn.{qkv,proj}, model.visual.blocks.N.mlp.{fc1,fc2},
  merger model.visual.merger.mlp.{0,2};
- Qwen2.5-VL tower: model.visual.blocks.N.attn.{qkv,proj}, model.visual.blocks.N.mlp.{gate,up,down}_proj,
  merger model.visual.merger.mlp.{0,2};
- Qwen3-VL tower: model.visual.blocks.N.attn.{qkv,proj}, model.visual.blocks.N.mlp.linear_fc{1,2},
  mergers model.visual.merger.linear_fc{1,2} and model.visual.deepstack_merger_list.N.linear_fc{1,2}.

The names q_proj, gate_proj, ... alone would also match Qwen2.5-VL's tower MLP, so the regexes
below keep the language model and the tower apart.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

# The language model's attention and MLP projections (every family).
LANGUAGE_MODEL = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
# The vision tower: its patch embedding and every Linear layer of its blocks and merger(s) (every family).
VISION_TOWER = r".*visual\..*\.(qkv|proj|fc1|fc2|linear_fc1|linear_fc2|gate_proj|up_proj|down_proj|mlp\.0|mlp\.2)"
# Both at once.
WHOLE_MODEL = f"({LANGUAGE_MODEL})|({VISION_TOWER})"

_base_models: dict[Path, Any] = {}


def base_model(model_dir: Path) -> Any:
    """transformers' model of the checkpoint (float32, eval), loaded once per checkpoint; callers
    that change it (PEFT wraps modules in place) take a copy."""
    if model_dir not in _base_models:
        from transformers import AutoModelForImageTextToText

        _base_models[model_dir] = AutoModelForImageTextToText.from_pretrained(
            str(model_dir), dtype=torch.float32
        ).eval()
    return _base_models[model_dir]


def write_adapter(
    model_dir: Path,
    folder: Path,
    r: int,
    alpha: int,
    target_modules: list[str] | str,
    seed: int,
    **lora_config_kwargs: Any,
) -> Path:
    """PEFT's save_pretrained of a LoRA adapter on the checkpoint in `model_dir` whose lora_A and
    lora_B hold seeded random values (PEFT starts lora_B at zero, an adapter that changes nothing):
    each layer's update B @ A * scaling about half as large as the layer's own weight, enough to
    change greedy tokens. `lora_config_kwargs` go to LoraConfig (use_rslora, rank_pattern,
    alpha_pattern, modules_to_save, ...). Returns `folder` (adapter_config.json and
    adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, **lora_config_kwargs)
    model = get_peft_model(copy.deepcopy(base_model(model_dir)), config)
    generator = torch.Generator().manual_seed(seed)
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    assert layers, f"no module of {model_dir.name} matches {target_modules!r}"
    with torch.no_grad():
        for layer in layers:
            a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # [r, in], [out, r]
            rank, scaling = a.shape[0], layer.scaling["default"]
            # Entries of B @ A * scaling have std scaling * sqrt(rank) * std_a * std_b.
            std = (0.5 * float(layer.get_base_layer().weight.std()) / (scaling * rank**0.5)) ** 0.5
            a.copy_(torch.randn(a.shape, generator=generator) * std)
            b.copy_(torch.randn(b.shape, generator=generator) * std)
    model.save_pretrained(str(folder))
    return folder


def peft_model(model_dir: Path, folder: Path) -> Any:
    """transformers + PEFT: a copy of the checkpoint's model with the adapter in `folder` loaded
    by PeftModel.from_pretrained (from the files, as a user of PEFT loads it)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base_model(model_dir)), str(folder)).eval()
