"""The adapters a worker holds, and the rows of each in a step.

Adapters are read on first use (add, or a step naming one that was dropped) and kept up to
max_cpu_loras, the least recently used dropped first (read again from its folder when a request
names it); a step runs at most max_loras of them (the scheduler admits no more at once)."""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from vlmserve.lora.adapter import LoadedAdapter, read_adapter
from vlmserve.lora.layers import LoRARows, Rows, hook_layers, rows_of
from vlmserve.lora.request import AdapterInfo, LoRAError, LoRARequest
from vlmserve.models.loader import WeightTable

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        table_of = getattr(model, "weight_table", None)
        if table_of is None:
            raise LoRAError(
                f"{type(model).__name__} has no checkpoint weight table: LoRA adapters cannot be mapped onto it"
            )
        self.model = model
        self.table: WeightTable = table_of()
        self.vision: nn.Module | None = model.vision_encoder()  # type: ignore[operator]
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.capacity = max(max_cpu_loras or max_loras, max_loras)
        self.device = device
        self.dtype = dtype
        self.adapters: OrderedDict[str, LoadedAdapter] = OrderedDict()
        self.rows = LoRARows()
        self.hooked: set[str] = set()

    def add(self, lora: LoRARequest) -> AdapterInfo:
        """Read and check the adapter (again, where the one held by its name has another path or
        id); LoRAError where it cannot run on this model."""
        held = self.adapters.get(lora.lora_name)
        if held is None or held.request != lora:
            held = read_adapter(lora, self.model, self.table, self.vision, self.max_lora_rank, self.dtype, self.device)
            hook_layers(self.model, list(held.modules), self.rows, self.hooked)
            self.adapters[lora.lora_name] = held
            logger.info(
                "LoRA adapter %r loaded from %s: %d layers, rank %d, %.1f MiB%s",
                lora.lora_name,
                lora.lora_path,
                len(held.modules),
                held.max_rank,
                held.nbytes / 2**20,
                " (vision tower too)" if held.vision else "",
            )
        self.adapters.move_to_end(lora.lora_name)
        self._evict(keep={lora.lora_name})
        return AdapterInfo(held.vision, held.nbytes, held.max_rank, len(held.modules))

    def remove(self, lora_name: str) -> None:
        self.adapters.pop(lora_name, None)

    def _evict(self, keep: set[str]) -> None:
        for name in list(self.adapters):
            if len(self.adapters) <= self.capacity:
                return
            if name not in keep:
                del self.adapters[name]

    def get(self, lora: LoRARequest) -> LoadedAdapter:
        held = self.adapters.get(lora.lora_name)
        if held is None or held.request != lora:
            self.add(lora)
            held = self.adapters[lora.lora_name]
        self.adapters.move_to_end(lora.lora_name)
        return held

    @contextlib.contextmanager
    def step(
        self, loras: Sequence[LoRARequest | None], row_counts: Sequence[int], output_rows: Sequence[int] | None
    ) -> Iterator[None]:
        """The model's forward over a step whose sequence i has row_counts[i] rows and runs with
        loras[i] (None: the base model); output_rows: the rows kept past the last layer's
        attention (None: all)."""
        if not any(loras):
            yield
            return
        names = {lora.lora_name for lora in loras if lora is not None}
        if len(names) > self.max_loras:
            raise LoRAError(f"a step with {len(names)} adapters, above max_loras {self.max_loras}")
        owners: list[LoRARequest | None] = [lora for lora, n in zip(loras, row_counts, strict=True) for _ in range(n)]
        by_count: dict[int | None, list[tuple[LoadedAdapter, Rows]]] = {len(owners): self._segments(owners)}
        if output_rows is not None:
            by_count[len(output_rows)] = self._segments([owners[i] for i in output_rows])
        with self.rows.use(self.model, by_count):
            yield

    def _segments(self, owners: list[LoRARequest | None]) -> list[tuple[LoadedAdapter, Rows]]:
        indexes: dict[LoRARequest, list[int]] = {}
        for i, lora in enumerate(owners):
            if lora is not None:
                indexes.setdefault(lora, []).append(i)
        return [(self.get(lora), rows_of(rows, len(owners), self.device)) for lora, rows in indexes.items()]

    @contextlib.contextmanager
    def encoding(self, lora: LoRARequest | None) -> Iterator[None]:
        """The vision tower's forward over images of one adapter's requests (None: the base's)."""
        if lora is None:
            yield
            return
        with self.rows.use(self.model, {None: [(self.get(lora), None)]}):
            yield
