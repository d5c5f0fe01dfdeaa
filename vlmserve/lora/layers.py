"""The low-rank products added to the model's linear layers, each row of a step with its own
adapter or none.

A layer some loaded adapter targets carries a forward hook (added when the first such adapter is
loaded; a layer no adapter targets runs as it always did). While a step runs, LoRARows says which
rows use which adapter: for each adapter in the step, its rows are gathered, multiplied by its A
(one product for all the parts of a fused layer) and B, and added into the layer's output at
those rows: a segmented product, one per adapter in the step, not a forward per adapter.

The rows a layer sees are the step's rows, or fewer in the last decoder layer (past attention
only the rows whose hidden states are kept: AttentionMetadata.output_rows); the hook tells them
apart by their count. The vision tower runs one adapter for all its rows (the runner encodes the
images of each adapter together), so its rows need no map at all."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vlmserve.distributed import all_reduce
from vlmserve.lora.adapter import LoadedAdapter

# Rows of one adapter: every row (None), a contiguous range, or an index tensor.
Rows = slice | torch.Tensor | None


def rows_of(indexes: list[int], total: int, device: torch.device) -> Rows:
    """The cheapest form of these (ascending) row indexes."""
    if len(indexes) == total:
        return None
    if indexes[-1] - indexes[0] + 1 == len(indexes):
        return slice(indexes[0], indexes[-1] + 1)
    return torch.tensor(indexes, dtype=torch.long, device=device)


class LoRARows:
    """The adapters of the forward running now, by the number of rows a layer sees: {num_rows:
    [(adapter, its rows)]}; None as the key: whatever the count (every row one adapter)."""

    def __init__(self) -> None:
        self.by_count: dict[int | None, list[tuple[LoadedAdapter, Rows]]] = {}

    @contextlib.contextmanager
    def use(self, model: nn.Module, by_count: dict[int | None, list[tuple[LoadedAdapter, Rows]]]) -> Iterator[None]:
        """Run the model's forward with these adapters. A decoder that runs whole decode steps in
        one kernel call (models/fused_decode.py) does not call its layers, so it is set aside
        meanwhile (the layer-by-layer path gives the same results)."""
        if not by_count:
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


class LoRAHook:
    """The forward hook of one layer (its name in the model: what the adapters' deltas are keyed by)."""

    def __init__(self, name: str, rows: LoRARows) -> None:
        self.name = name
        self.rows = rows

    def __call__(
        self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
    ) -> torch.Tensor | None:
        by_count = self.rows.by_count
        if not by_count:
            return None
        x = inputs[0]
        segments = by_count.get(None) or by_count.get(x.shape[0])
        if segments is None:
            raise RuntimeError(
                f"LoRA layer {self.name}: {x.shape[0]} rows, the step has adapters for {sorted(by_count, key=str)}"
            )
        for adapter, rows in segments:
            delta = adapter.modules.get(self.name)
            if delta is None:
                continue
            xs = x if rows is None else x[rows]
            h = xs.to(delta.a.dtype) @ delta.a.T
            if delta.reduce:
                h = all_reduce(h)  # a row-parallel layer: each rank's x @ A.T is a partial sum
            for (offset, size, r0, r1), b in zip(delta.parts, delta.b, strict=True):
                d = (h[:, r0:r1] @ b.T).to(output.dtype)
                if rows is None:
                    output[:, offset : offset + size] += d
                else:
                    output[rows, offset : offset + size] += d
        return output


def hook_layers(model: nn.Module, names: list[str], rows: LoRARows, hooked: set[str]) -> None:
    """Hook the named layers not hooked yet (`hooked` grows by them)."""
    modules = dict(model.named_modules())
    for name in names:
        if name not in hooked:
            modules[name].register_forward_hook(LoRAHook(name, rows))
            hooked.add(name)
