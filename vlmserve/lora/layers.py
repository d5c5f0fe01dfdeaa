"""The low-rank products added to the model's linear layers, each row of a step with its own
adapter or none.

A layer some loaded adapter targets carries a forward hook (added when the first such adapter is
loaded; a layer no adapter targets runs as it always did) and max_loras slots: A [parts * slots *
rank, in] and, per part of its output, B [size, slots * rank] (3 parts for a fused q, k, v; 2 for
gate, up; `rank` is max_lora_rank). An adapter running in a step sits in a slot: its A rows and B
columns there, zeros where it does not reach (a layer it does not target, a part it leaves out,
ranks below the largest). A step's update of a layer is then a product per part whatever its
adapters:

    h = x @ A.T            (every row against every slot)
    h *= mask              (each row keeps its own slot's columns; the base model's none)
    out += h @ B.T         (for a fused layer, part by part: B is block-diagonal over its parts)

the gathered form of vLLM's punica kernels (not a forward per adapter, nor a gather of per-row
matrices). The products run on the whole slot matrices, whose shapes are fixed, with the
engine's CPU bf16 matrix product chosen for them (torch's bf16 product of a narrow output, such
as x @ A.T's few columns, takes a slow generic path on the CPU: ~40x an fp32 one, measured).

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
from vlmserve.kernels import LinearOp
from vlmserve.lora.adapter import ModuleDelta


@dataclass
class StepRows:
    """The slot of each of one row count's rows: slot_of_row [rows] (-1: the base model), or
    [1] (every row the same slot); num_slots slots in all."""

    slot_of_row: torch.Tensor
    num_slots: int
    # The mask of each slot width, [rows or 1, num_slots * cols], made on first need.
    masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def mask(self, cols: int, dtype: torch.dtype) -> torch.Tensor:
        mask = self.masks.get((cols, dtype))
        if mask is None:
            slots = torch.arange(self.num_slots, device=self.slot_of_row.device).repeat_interleave(cols)
            mask = self.masks[cols, dtype] = (self.slot_of_row[:, None] == slots[None, :]).to(dtype)
        return mask


def step_rows(slot_of_row: list[int], num_slots: int, device: torch.device) -> StepRows | None:
    """A step's rows by slot (-1: none); None where no row has an adapter."""
    used = {s for s in slot_of_row if s >= 0}
    if not used:
        return None
    if len(used) == 1 and min(slot_of_row) >= 0:
        slot_of_row = [used.pop()]
    return StepRows(torch.tensor(slot_of_row, dtype=torch.long, device=device), num_slots)


class LoRARows:
    """The slots of the forward running now, by the number of rows a layer sees; None as the
    key: whatever the count (every row one adapter); None as a value: no row of that count has
    an adapter."""

    def __init__(self, model: nn.Module) -> None:
        self.by_count: dict[int | None, StepRows | None] = {}
        # The decoders that may run whole decode steps in one kernel call (models/fused_decode.py),
        # found once: they do not call their layers, so a step with adapters sets them aside.
        self.decoders = [m for m in model.modules() if hasattr(m, "fused_decode")]

    @contextlib.contextmanager
    def use(self, by_count: dict[int | None, StepRows | None]) -> Iterator[None]:
        """Run the model's forward with these rows, its fused decode steps set aside meanwhile (the
        layer-by-layer path gives the same results)."""
        if not any(by_count.values()):
            yield
            return
        fused: list[tuple[nn.Module, Any]] = [
            (m, m.fused_decode) for m in self.decoders if getattr(m, "fused_decode", None) is not None
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
        parts: list[tuple[int, int]],
        rank: int,
        slots: int,
        reduce: bool,
        dtype: torch.dtype,
        device: torch.device,
        op: LinearOp,
    ) -> None:
        """parts: the (offset, size) of each fused part of the layer's output (one for a layer
        not fused). A holds part p's ranks of slot s at rows (p * slots + s) * rank; B one matrix
        per part, [size, slots * rank]: a fused layer's B is block-diagonal over its parts, so
        each part's product reads only its own block."""
        self.name = name
        self.rows = rows
        self.op = op
        self.parts = parts
        self.rank = rank
        self.slots = slots
        self.reduce = reduce  # row-parallel: x @ A.T is each rank's partial sum
        self.a = torch.zeros(len(parts) * slots * rank, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(size, slots * rank, dtype=dtype, device=device) for _, size in parts]

    @property
    def nbytes(self) -> int:
        """The slots' A and B, all of them."""
        return sum(t.numel() * t.element_size() for t in [self.a, *self.b])

    def fits(self, delta: ModuleDelta) -> bool:
        """Whether each of the update's parts is one of the layer's (its rank is checked when read)."""
        return all((offset, size) in self.parts for offset, size, _, _ in delta.parts)

    def load(self, slot: int, delta: ModuleDelta | None) -> None:
        """Put an adapter's update in a slot (None: the adapter leaves this layer alone)."""
        r = self.rank
        for p, b in enumerate(self.b):
            self.a[(p * self.slots + slot) * r :][:r].zero_()
            b[:, slot * r : (slot + 1) * r].zero_()
        if delta is None:
            return
        for (offset, size, r0, r1), part in zip(delta.parts, delta.b, strict=True):
            p = self.parts.index((offset, size))
            self.a[(p * self.slots + slot) * r :][: r1 - r0] = delta.a[r0:r1]
            self.b[p][:, slot * r : slot * r + r1 - r0] = part

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
        h = self.op(x.to(self.a.dtype), self.a, None).view(x.shape[0], len(self.parts), -1)
        h *= rows.mask(self.rank, h.dtype)[:, None, :]
        if self.reduce:
            h = all_reduce(h)
        if len(self.parts) == 1:
            output += self.op(h[:, 0], self.b[0], None).to(output.dtype)
            return output
        for p, (offset, size) in enumerate(self.parts):
            output[:, offset : offset + size] += self.op(h[:, p], self.b[p], None).to(output.dtype)
        return output
