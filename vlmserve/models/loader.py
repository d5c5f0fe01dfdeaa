"""Table-driven weight loading: checkpoint names map onto (possibly fused) parameters. Under
tensor parallelism a parameter whose module declares a ShardSpec (models/parallel.py) takes only
its rank's slice of each checkpoint tensor (its own offsets replace the table's `shards`). Stacked
expert weights may come either way round (models/expert_layout.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from vlmserve.models.expert_layout import CheckpointExpertLayouts, to_out_in
from vlmserve.models.parallel import ShardSpec, spec_of


@dataclass(frozen=True)
class WeightTable:
    # Checkpoint prefixes rewritten to ours, first match wins (e.g. transformers 5's
    # "model.language_model." -> "model.").
    renames: tuple[tuple[str, str], ...] = ()
    # Checkpoint module name -> (fused module name, shard id), e.g. "q_proj" -> ("qkv_proj", "q").
    packed: dict[str, tuple[str, str]] = field(default_factory=dict)
    # (Fused parameter's full name, shard id) -> (start, size) along its first dimension; the full
    # name tells apart fused modules of one name in different towers (decoder vs vision MLP).
    # Only for parameters without a ShardSpec (models/parallel.py), whose own offsets come first.
    shards: Callable[[str, str], tuple[int, int]] | None = None
    # Reshape a checkpoint tensor for our parameter (e.g. Conv3d kernel -> Linear weight).
    reshape: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    # Checkpoint names to drop (tied lm_head, rotary buffers some exports carry).
    ignore: Callable[[str], bool] = lambda name: False
    # Experts published one by one and stacked here into [num_experts, out, in] parameters, as
    # transformers' MoE conversion stacks them: "<p>.experts.<e>.<module>.weight" -> row e of
    # "<p>.experts.<stacked>", all of it (shard None) or the shard's rows (`shards` gives where).
    experts: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    # Stacked expert parameters (our names; [experts, out, in]) that checkpoints store either way
    # round, [experts, out, in] or [experts, in, out]: told apart by models/expert_layout.py.
    either_layout: frozenset[str] = frozenset()
    # config.json's transformers_version (the release that wrote the checkpoint), for those
    # tensors whose shapes cannot tell.
    transformers_version: str | None = None


def resolve_name(ckpt_name: str, table: WeightTable) -> tuple[str, str | None, int | None]:
    """A checkpoint tensor's name -> (our parameter's name, the shard id of its part of a fused
    parameter or None, the expert's row of a stacked parameter or None)."""
    name = ckpt_name
    for old, new in table.renames:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    parts = name.split(".")
    for i, part in enumerate(parts):
        if (
            part == "experts"
            and len(parts) == i + 4
            and parts[i + 1].isdigit()
            and parts[i + 2] in table.experts
            and parts[i + 3] == "weight"
        ):
            stacked, shard = table.experts[parts[i + 2]]
            return ".".join([*parts[: i + 1], stacked]), shard, int(parts[i + 1])
        if part in table.packed:
            fused, shard = table.packed[part]
            parts[i] = fused
            return ".".join(parts), shard, None
    return name, None, None


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], table: WeightTable) -> None:
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    unexpected: list[str] = []
    layouts = CheckpointExpertLayouts(table.transformers_version)
    # Square stacked expert tensors, read both ways round: loaded once the rest of the checkpoint
    # has said which (none in the published checkpoints, whose in and out sizes differ).
    square: list[tuple[str, torch.Tensor, str]] = []
    for ckpt_name, tensor in weights:
        if table.ignore(ckpt_name):
            continue
        name, shard, expert = resolve_name(ckpt_name, table)
        if name not in params:
            unexpected.append(ckpt_name)
            continue
        if name in table.reshape:
            tensor = table.reshape[name](tensor)
        if name in table.either_layout and expert is None and shard is None:
            owner, _, attr = name.rpartition(".")
            whole = _checkpoint_shape(params[name], spec_of(modules[owner], attr))
            layout = layouts.layout_of(ckpt_name, tensor, whole)
            if layout is None:
                square.append((ckpt_name, tensor, name))
                continue
            tensor = to_out_in(tensor, layout)
        loaded.add(_copy_in(ckpt_name, tensor, name, shard, expert, params, modules, table))
    if unexpected:
        raise ValueError(f"checkpoint holds weights this model does not have: {unexpected[:8]}")
    for ckpt_name, tensor, name in square:
        tensor = to_out_in(tensor, layouts.resolve(ckpt_name, tensor))
        loaded.add(_copy_in(ckpt_name, tensor, name, None, None, params, modules, table))
    expected: set[str] = set()
    fused_shards: dict[str, list[str]] = {}
    for fused, shard in table.packed.values():
        fused_shards.setdefault(fused, []).append(shard)
    expert_shards: dict[str, list[str | None]] = {}
    for stacked, expert_shard in table.experts.values():
        expert_shards.setdefault(stacked, []).append(expert_shard)
    for name in params:
        module = name.rsplit(".", 2)[-2] if "." in name else name
        last = name.rsplit(".", 1)[-1]
        if module == "experts" and last in expert_shards:
            expected.update(
                f"{name}#{e}" + ("" if s is None else f"#{s}")
                for e in range(params[name].shape[0])
                for s in expert_shards[last]
            )
        elif module in fused_shards:
            expected.update(f"{name}#{s}" for s in fused_shards[module])
        else:
            expected.add(name)
    # A fused or stacked parameter the checkpoint holds whole covers all its shards.
    missing = sorted(m for m in expected - loaded if m.split("#")[0] not in loaded)
    if missing:
        raise ValueError(f"checkpoint lacks weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def _checkpoint_shape(param: nn.Parameter, spec: ShardSpec | None) -> tuple[int, ...]:
    """The whole checkpoint tensor's shape of a parameter that may hold only this rank's slice."""
    shape = list(param.shape)
    if spec is not None:
        shape[spec.dim] = spec.full_size(None)
    return tuple(shape)


def _copy_in(
    ckpt_name: str,
    tensor: torch.Tensor,
    name: str,
    shard: str | None,
    expert: int | None,
    params: dict[str, nn.Parameter],
    modules: dict[str, nn.Module],
    table: WeightTable,
) -> str:
    """Copy checkpoint tensor `ckpt_name` (already in our layout) into its place in parameter
    `name` (shard `shard` of it, row `expert` of it, this rank's slice of it); the key it loaded."""
    target = params[name].data
    key = name
    if expert is not None:
        if not 0 <= expert < target.shape[0]:
            raise ValueError(f"weight {ckpt_name}: expert {expert}, the model has {target.shape[0]} experts")
        target = target[expert]
        key = f"{name}#{expert}"
    owner, _, attr = name.rpartition(".")
    spec = spec_of(modules[owner], attr)
    if spec is not None:
        # The rank's slice (all of it at tp_size 1); a stacked expert's row has one dim less.
        dim = spec.dim - (expert is not None)
        if tensor.ndim <= dim or tensor.shape[dim] != spec.full_size(shard):
            raise ValueError(
                f"weight {ckpt_name}: checkpoint shape {tuple(tensor.shape)}, model expects "
                f"{spec.full_size(shard)} along dimension {dim}"
            )
        start, size, tensor = spec.narrow(tensor, shard, dim)
        target = target.narrow(dim, start, size)
    elif shard is not None:
        assert table.shards is not None
        start, size = table.shards(name, shard)
        target = target.narrow(0, start, size)
    if shard is not None:
        key = f"{key}#{shard}"
    if target.shape != tensor.shape:
        raise ValueError(
            f"weight {ckpt_name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}"
        )
    target.copy_(tensor)
    return key
