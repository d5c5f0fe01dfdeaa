"""An adapter folder in PEFT's format read and checked against the model it is to run on.

PEFT writes adapter_config.json (r, lora_alpha, use_rslora, rank_pattern, alpha_pattern,
target_modules, modules_to_save, ...) and adapter_model.safetensors, whose tensors are named
`base_model.model.<the transformers module's name>.lora_A.weight` ([r, in]) and `.lora_B.weight`
([out, r]). A target layer's output gains scaling * (x @ A.T) @ B.T, scaling = alpha / r (alpha /
sqrt(r) with use_rslora), r and alpha per module where the patterns name it.

The module names are the checkpoint's, so the model's own weight table (models/loader.py) maps
them onto our layers: "q_proj" is the q part of our fused qkv_proj (its rows at the q offset), and
so on. Under tensor parallelism each rank keeps the slice its base layer holds: B's rows of a
column-parallel layer, A's columns of a row-parallel one (whose x @ A.T is then summed over the
ranks before B)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from vlmserve.lora.request import LoRAError, LoRARequest
from vlmserve.models.loader import WeightTable, resolve_name
from vlmserve.models.parallel import ShardSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's prefix of every saved tensor name (its wrapper around the transformers model).
PEFT_PREFIX = "base_model.model."


@dataclass
class ModuleDelta:
    """One layer's low-rank update on this rank: h = x @ a.T (summed over the ranks for a
    row-parallel layer: its slots know), then for each part (out_offset, out_size, rank_start, rank_end) with its b
    [out_size, rank_end - rank_start] (scaling folded in): out[:, out_offset : out_offset +
    out_size] += h[:, rank_start:rank_end] @ b.T. A fused layer has one part per checkpoint module
    the adapter targets in it (q, k, v; gate, up)."""

    a: torch.Tensor
    parts: list[tuple[int, int, int, int]]
    b: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [self.a, *self.b])


@dataclass
class LoadedAdapter:
    """An adapter ready to run: its update per layer (our module names), whether it changes the
    vision tower's output (then encoder outputs are its own), its largest rank."""

    request: LoRARequest
    modules: dict[str, ModuleDelta]
    vision: bool
    max_rank: int

    @property
    def nbytes(self) -> int:
        return sum(delta.nbytes for delta in self.modules.values())


def _pattern_value(patterns: Mapping[str, float], module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key whose regex matches the end of
    the module's name at a dot boundary."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return default


def read_config(lora: LoRARequest) -> dict[str, object]:
    folder = Path(lora.lora_path)
    where = f"adapter {lora.lora_name!r} ({folder})"
    if not folder.is_dir():
        raise LoRAError(f"{where}: no such folder; lora_path must be a folder holding {CONFIG_FILE} and {WEIGHTS_FILE}")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise LoRAError(f"{where}: no {CONFIG_FILE} in the folder (PEFT's save_pretrained writes it)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise LoRAError(f"{where}: {CONFIG_FILE} is not valid JSON ({error})") from error
    if not isinstance(config, dict):
        raise LoRAError(f"{where}: {CONFIG_FILE} holds {type(config).__name__}, not an object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{where}: peft_type {peft_type!r}; only LoRA adapters (peft_type 'LORA') are served")
    refusals = {
        "modules_to_save": "whole modules saved beside the adapter (modules_to_save) are not served",
        "use_dora": "DoRA adapters (use_dora) are not served",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) does not apply to Qwen models",
        "layers_to_transform": "layers_to_transform is not served; target the layers by name instead",
    }
    for key, why in refusals.items():
        if config.get(key):
            raise LoRAError(f"{where}: {CONFIG_FILE} sets {key}={config[key]!r}: {why}")
    if config.get("bias", "none") != "none":
        raise LoRAError(
            f"{where}: bias={config['bias']!r}: adapters that train biases are not served (bias 'none' only)"
        )
    return config


def read_adapter(
    lora: LoRARequest,
    model: nn.Module,
    table: WeightTable,
    vision: nn.Module | None,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoadedAdapter:
    """The adapter in `lora.lora_path`, checked against `model` (whose checkpoint names `table`
    maps; `vision` its vision encoder, to tell which layers are the tower's): LoRAError naming
    what does not fit."""
    config = read_config(lora)
    where = f"adapter {lora.lora_name!r} ({lora.lora_path})"
    weights_path = Path(lora.lora_path) / WEIGHTS_FILE
    if not weights_path.is_file():
        other = [p.name for p in Path(lora.lora_path).glob("adapter_model.*")]
        hint = f" (found {other[0]}: save it with safe_serialization=True)" if other else ""
        raise LoRAError(f"{where}: no {WEIGHTS_FILE} in the folder{hint}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no iteration)
                module, kind = _split_name(name, where)
                pairs.setdefault(module, {})[kind] = f.get_tensor(name)
    except LoRAError:
        raise
    except Exception as error:  # safetensors' own errors: a truncated or foreign file
        raise LoRAError(f"{where}: {WEIGHTS_FILE} cannot be read ({error})") from error
    if not pairs:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    r_default = int(config.get("r", 8))  # type: ignore[call-overload]
    alpha_default = float(config.get("lora_alpha", 8))  # type: ignore[arg-type]
    rslora = bool(config.get("use_rslora", False))
    rank_pattern: dict[str, int] = config.get("rank_pattern") or {}  # type: ignore[assignment]
    alpha_pattern: dict[str, float] = config.get("alpha_pattern") or {}  # type: ignore[assignment]
    modules = dict(model.named_modules())
    vision_names = {id(m) for m in vision.modules()} if vision is not None else set()
    pieces: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    touches_vision = False
    largest = 0
    for module_name in sorted(pairs):
        tensors = pairs[module_name]
        if set(tensors) != {"lora_A", "lora_B"}:
            missing = {"lora_A", "lora_B"} - set(tensors)
            raise LoRAError(f"{where}: module {module_name} has no {' or '.join(sorted(missing))} weight")
        a, b = tensors["lora_A"], tensors["lora_B"]
        name, shard, expert = resolve_name(f"{module_name}.weight", table)
        if name in table.reshape and a.ndim > 2 and b.ndim > 2 and all(k == 1 for k in b.shape[2:]):
            # A convolution stored as a linear layer (the patch embedding: stride == kernel): its
            # LoRA is a convolution of the same kernel into r channels, then a 1x1 one: as
            # matrices, A flattened as the weight is (channel, time, row, col) and B squeezed.
            a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], b.shape[1])
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(
                f"{where}: module {module_name}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                "are not [r, in] and [out, r] of one rank r"
            )
        rank = a.shape[0]
        if rank > max_rank:
            raise LoRAError(
                f"{where}: module {module_name} has rank {rank}, above max_lora_rank {max_rank}; "
                f"start the engine with max_lora_rank >= {rank} (--max-lora-rank)"
            )
        r_module = _pattern_value(rank_pattern, module_name, r_default)
        if r_module != rank:
            raise LoRAError(
                f"{where}: module {module_name}: its weights have rank {rank}, adapter_config.json says {r_module:g}"
            )
        alpha = _pattern_value(alpha_pattern, module_name, alpha_default)
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        target = name.removesuffix(".weight")
        layer = modules.get(target)
        if (
            table.ignore(f"{module_name}.weight")
            or expert is not None
            or layer is None
            or not hasattr(layer, "in_features")
            or target.endswith("lm_head")
        ):
            what = "an expert of a mixture-of-experts block" if expert is not None else "a linear layer of this model"
            raise LoRAError(
                f"{where}: target module {module_name} is not {what} that adapters may change "
                f"(the attention and MLP projections of the language model, the vision tower's and "
                f"the merger's linear layers); is the adapter for another model?"
            )
        spec = weight_spec(layer)
        offset, size, a_local, b_local = _local_slices(layer, spec, shard, a, b, table, target)
        if a.shape[1] != _full_in(layer, spec) or b.shape[0] != _full_out(spec, shard, layer, size):
            raise LoRAError(
                f"{where}: module {module_name}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} do not fit the "
                f"model's layer of {_full_in(layer, spec)} inputs and {_full_out(spec, shard, layer, size)} outputs; "
                "is the adapter for another model?"
            )
        pieces.setdefault(target, []).append((offset, size, a_local, b_local * scaling))
        touches_vision = touches_vision or id(layer) in vision_names
        largest = max(largest, rank)
    deltas = {name: _stack(parts, dtype, device) for name, parts in pieces.items()}
    return LoadedAdapter(lora, deltas, touches_vision, largest)


def _split_name(name: str, where: str) -> tuple[str, str]:
    """A saved tensor's name -> (the transformers module it adapts, "lora_A" or "lora_B")."""
    for kind in ("lora_A", "lora_B"):
        for tail in (f".{kind}.weight", f".{kind}.default.weight"):
            if name.endswith(tail):
                return name[: -len(tail)].removeprefix(PEFT_PREFIX), kind
    if ".base_layer." in name:
        raise LoRAError(
            f"{where}: {name} is a copy of a base layer saved with the adapter (PEFT does so for an adapted "
            "output layer or embedding): adapters of the output layer and embeddings are not served"
        )
    if ".lora_embedding_" in name:
        raise LoRAError(f"{where}: {name}: adapters of embedding layers are not served")
    if ".lora_magnitude_vector" in name:
        raise LoRAError(f"{where}: {name}: DoRA adapters are not served")
    raise LoRAError(f"{where}: {name} is not a LoRA weight (lora_A / lora_B) this engine serves")


def weight_spec(layer: nn.Module) -> ShardSpec | None:
    """The tensor-parallel slice the layer holds of its checkpoint weight (quantized layers keep
    their float weight's spec as qweight's)."""
    shards: dict[str, ShardSpec] = getattr(layer, "tp_shards", {})
    return shards.get("weight") or shards.get("qweight")


def _full_in(layer: nn.Module, spec: ShardSpec | None) -> int:
    if spec is not None and spec.dim == 1:
        return spec.full_size(None)
    return int(layer.in_features)  # type: ignore[arg-type]


def _full_out(spec: ShardSpec | None, shard: str | None, layer: nn.Module, local_size: int) -> int:
    if spec is not None and spec.dim == 0:
        return spec.full_size(shard)
    return local_size if shard is not None else int(layer.out_features)  # type: ignore[arg-type]


def _local_slices(
    layer: nn.Module,
    spec: ShardSpec | None,
    shard: str | None,
    a: torch.Tensor,
    b: torch.Tensor,
    table: WeightTable,
    target: str,
) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """(this rank's output offset and size in the layer, its A, its B)."""
    if spec is not None and spec.dim == 0:
        if b.shape[0] != spec.full_size(shard):
            return 0, b.shape[0], a, b  # reported by the caller's shape check
        offset, size, b_local = spec.narrow(b, shard, 0)
        return offset, size, a, b_local
    if spec is not None and spec.dim == 1:
        if a.shape[1] != spec.full_size(None):
            return 0, b.shape[0], a, b
        _, _, a_local = spec.narrow(a, None, 1)
        return 0, int(layer.out_features), a_local, b  # type: ignore[arg-type]
    if shard is not None:
        assert table.shards is not None, f"{target}: a fused layer without offsets"
        offset, size = table.shards(f"{target}.weight", shard)
        return offset, size, a, b
    return 0, int(layer.out_features), a, b  # type: ignore[arg-type]


def _stack(
    parts: list[tuple[int, int, torch.Tensor, torch.Tensor]], dtype: torch.dtype, device: torch.device
) -> ModuleDelta:
    """A layer's parts as one A (their ranks stacked: one product for x @ A.T) and a B per part."""
    parts = sorted(parts, key=lambda p: p[0])
    spans, start = [], 0
    for offset, size, a, _ in parts:
        spans.append((offset, size, start, start + a.shape[0]))
        start += a.shape[0]
    a_all = torch.cat([a for _, _, a, _ in parts]).to(device=device, dtype=dtype).contiguous()
    b_all = [b.to(device=device, dtype=dtype).contiguous() for _, _, _, b in parts]
    return ModuleDelta(a_all, spans, b_all)
