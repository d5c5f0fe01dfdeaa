"""Table-driven weight loading: checkpoint names map onto (possibly fused) parameters."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class WeightTable:
    # Checkpoint prefixes rewritten to ours, first match wins (e.g. transformers 5's
    # "model.language_model." -> "model.").
    renames: tuple[tuple[str, str], ...] = ()
    # Checkpoint module name -> (fused module name, shard id), e.g. "q_proj" -> ("qkv_proj", "q").
    packed: dict[str, tuple[str, str]] = field(default_factory=dict)
    # (Fused parameter's full name, shard id) -> (start, size) along its first dimension; the full
    # name tells apart fused modules of one name in different towers (decoder vs vision MLP).
    shards: Callable[[str, str], tuple[int, int]] | None = None
    # Reshape a checkpoint tensor for our parameter (e.g. Conv3d kernel -> Linear weight).
    reshape: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    # Checkpoint names to drop (tied lm_head, rotary buffers some exports carry).
    ignore: Callable[[str], bool] = lambda name: False


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], table: WeightTable) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        if table.ignore(ckpt_name):
            continue
        name = ckpt_name
        for old, new in table.renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        shard: str | None = None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in table.packed:
                fused, shard = table.packed[part]
                parts[i] = fused
                name = ".".join(parts)
                break
        if name not in params:
            unexpected.append(ckpt_name)
            continue
        if name in table.reshape:
            tensor = table.reshape[name](tensor)
        param = params[name]
        if shard is None:
            target = param.data
            loaded.add(name)
        else:
            assert table.shards is not None
            start, size = table.shards(name, shard)
            target = param.data.narrow(0, start, size)
            loaded.add(f"{name}#{shard}")
        if target.shape != tensor.shape:
            raise ValueError(
                f"weight {ckpt_name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}"
            )
        target.copy_(tensor)
    if unexpected:
        raise ValueError(f"checkpoint holds weights this model does not have: {unexpected[:8]}")
    expected: set[str] = set()
    fused_shards: dict[str, list[str]] = {}
    for fused, shard in table.packed.values():
        fused_shards.setdefault(fused, []).append(shard)
    for name in params:
        module = name.rsplit(".", 2)[-2] if "." in name else name
        if module in fused_shards:
            expected.update(f"{name}#{s}" for s in fused_shards[module])
        else:
            expected.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
