"""The low-rank products added to the model's linear layers, each row of a step with its own
adapter or none.

A layer some loaded adapter targets carries a forward hook (added when the first such adapter is
loaded; a layer no adapter targets runs as it always did) and max_loras slots: A [slots * cols,
in] and B [out, slots * cols], `cols` = max_lora_rank times the layer's parts (3 for a fused q, k,
v; 2 for gate, up). An adapter running in a step sits in a slot: its A rows and B columns there,
zeros where it does not reach (a layer it does not target, a part it leaves out, ranks below the
largest). A step's update of a layer is then two products whatever its adapters:

    h = x @ A.T            (every row against every slot in use)
    h *= mask              (each row keeps its own slot's columns; the base model's none)
    out += h @ B.T

the gathered form of vLLM's punica kernels (not a forward per adapter, nor a gather of per-row
matrices). A step of one adapter on every row (the vision tower's, which the runner encodes per
adapter) needs no mask.

The rows a layer sees are the step's rows, or fewer in the last decoder layer (past attention
only the rows whose hidden states are kept: AttentionMetadata.output_rows); the hook tells them
apart by their count."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vlmserve.distributed import all_reduce
from vlmserve.lora.adapter import ModuleDelta


@dataclass
class StepRows:
    """The slots of one row count's rows: slot_of_row [rows] (-1: the base model) or None (every
    row in slot `first`); the slots in use are first..last (one contiguous range of columns)."""

    slot_of_row: torch.Tensor | None
    first: int
    last: int
    # The mask of each slot width in use, [rows, (last - first + 1) * cols], made on first need.
    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, cols: int, dtype: torch.dtype) -> torch.Tensor:
        mask = self.masks.get(cols)
        if mask is None:
            assert self.slot_of_row is not None
            slots = torch.arange(self.first, self.last + 1, device=self.slot_of_row.device).repeat_interleave(cols)
            mask = self.masks[cols] = (self.slot_of_row[:, None] == slots[None, :]).to(dtype)
        return mask


def step_rows(slot_of_row: list[int], device: torch.device) -> StepRows | None:
    """A step's rows by slot (-1: none); None where no row has an adapter."""
    used = sorted({s for s in slot_of_row if s >= 0})
    if not used:
        return None
    if len(used) == 1 and len(slot_of_row) and min(slot_of_row) >= 0:
        return StepRows(None, used[0], used[0])
    return StepRows(torch.tensor(slot_of_row, dtype=torch.long, device=device), used[0], used[-1])


class LoRARows:
    """The slots of the forward running now, by the number of rows a layer sees; None as the
    key: whatever the count (every row one adapter); None as a value: no row of that count has
    an adapter."""

    def __init__(self) -> None:
        self.by_count: dict[int | None, StepRows | None] = {}

    @contextlib.contextmanager
    def use(self, model: nn.Module, by_count: dict[int | None, StepRows | None]) -> Iterator[None]:
        """Run the model's forward with these rows. A decoder that runs whole decode steps in one
        kernel call (models/fused_decode.py) does not call its layers, so it is set aside
        meanwhile (the layer-by-layer path gives the same results)."""
        if not any(by_count.values()):
            yield
            return
        fused: list[tuple[nn.Module, Any]] = [
            (m, m.fused_decode) for m in model.modules() if getattr(m, "fused_decode", None) is not None
        ]
        for module, _ in fused:
            module.fused_decode = None  # type: ignore[assignment]
        self.by_count = by_count
        try:
            yield
        finally:
            self.by_count = {}
            for module, call in fused:
                module.fused_decode = call


class LoRALayer:
    """One layer's slots and its forward hook (`name`: the layer's name in the model, what the
    adapters' updates are keyed by)."""

    def __init__(
        self,
        name: str,
        rows: LoRARows,
        in_features: int,
        out_features: int,
        cols: int,
        slots: int,
        reduce: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.name = name
        self.rows = rows
        self.cols = cols
        self.reduce = reduce  # row-parallel: x @ A.T is each rank's partial sum
        self.a = torch.zeros(slots * cols, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(out_features, slots * cols, dtype=dtype, device=device)

    def load(self, slot: int, delta: ModuleDelta | None) -> None:
        """Put an adapter's update in a slot (None: the adapter leaves this layer alone)."""
        lo = slot * self.cols
        a, b = self.a[lo : lo + self.cols], self.b[:, lo : lo + self.cols]
        a.zero_()
        b.zero_()
        if delta is None:
            return
        a[: delta.a.shape[0]] = delta.a
        for (offset, size, r0, r1), part in zip(delta.parts, delta.b, strict=True):
            b[offset : offset + size, r0:r1] = part

    def __call__(
        self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
    ) -> torch.Tensor | None:
        by_count = self.rows.by_count
        if not by_count:
            return None
        x = inputs[0]
        key = None if None in by_count else x.shape[0]
        if key not in by_count:
            raise RuntimeError(f"LoRA layer {self.name}: {x.shape[0]} rows, the step's are {sorted(by_count, key=str)}")
        rows = by_count[key]
        if rows is None:
            return None
        lo, hi = rows.first * self.cols, (rows.last + 1) * self.cols
        h = x.to(self.a.dtype) @ self.a[lo:hi].T
        if rows.slot_of_row is not None:
            h *= rows.mask(self.cols, h.dtype)
        if self.reduce:
            h = all_reduce(h)
        output += (h @ self.b[:, lo:hi].T).to(output.dtype)
        return output
