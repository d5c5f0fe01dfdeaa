"""The adapters a worker holds, the slots they run from, and the rows of each in a step.

Two bounded pools, as vLLM's: adapters read from their folders (on add, or when a step names one
that was dropped) are kept up to max_cpu_loras, the least recently used dropped first; a step's
adapters sit in the layers' max_loras slots (layers.py), an adapter not in one copied into the
free slot, or the one used longest ago that this step does not need (the scheduler admits no more
than max_loras adapters at once)."""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from vlmserve.kernels import LinearOp, select_linear_op
from vlmserve.lora.adapter import LoadedAdapter, read_adapter, weight_spec
from vlmserve.lora.layers import LoRALayer, LoRARows, StepRows, step_rows
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
            raise LoRAError(f"{type(model).__name__} has no weight table: adapters cannot be mapped onto its layers")
        self.model = model
        self.table: WeightTable = table_of()
        self.vision: nn.Module | None = model.vision_encoder()  # type: ignore[operator]
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.capacity = max(max_cpu_loras or max_loras, max_loras)
        self.device = device
        self.dtype = dtype
        self.adapters: OrderedDict[str, LoadedAdapter] = OrderedDict()
        self.rows = LoRARows(model)
        # The hooked layers by name, and which adapter each slot holds (and when it last ran).
        self.layers: dict[str, LoRALayer] = {}
        self.slots: list[LoadedAdapter | None] = [None] * max_loras
        self.slot_last_used = [0] * max_loras
        self.steps = 0
        self._slot_op: LinearOp | None = None

    def reserved_bytes(self) -> int:
        """What adapters may take of the device, for the memory plan: the slots, and on the CPU
        the `capacity` adapters kept (host memory), in the model's dtype, each as one changing
        every linear layer at max_lora_rank (a fused layer's parts each of that rank), this
        rank's slices."""
        size = torch.empty((), dtype=self.dtype).element_size()
        rank, per_adapter = self.max_lora_rank, 0
        for module, parts, _ in self._linear_layers().values():
            per_adapter += rank * (len(parts) * int(module.in_features) + int(module.out_features))  # type: ignore[arg-type]
        held = self.capacity if self.device.type == "cpu" else 0  # the kept ones are in host memory
        return (held + self.max_loras) * per_adapter * size

    def _linear_layers(self) -> dict[str, tuple[nn.Module, list[tuple[int, int]], bool]]:
        """The layers adapters may change: name -> (module, the (offset, size) of each part of its
        output on this rank, row-parallel). A fused layer's parts are its checkpoint modules
        (q_proj, k_proj, v_proj -> qkv_proj): a tensor-parallel layer's spec lists them, a layer
        without one has the weight table's offsets."""
        found: dict[str, tuple[nn.Module, list[tuple[int, int]], bool]] = {}
        shards: dict[str, list[str]] = {}
        for fused, shard in self.table.packed.values():
            shards.setdefault(fused, []).append(shard)
        for name, module in self.model.named_modules():
            if not hasattr(module, "in_features") or name.endswith("lm_head"):
                continue
            spec = weight_spec(module)
            shard_ids = shards.get(name.rpartition(".")[2], [])
            parts = [(0, int(module.out_features))]  # type: ignore[arg-type]
            # (A spec's parts without names are the rank's slices of one checkpoint module, the
            # vision tower's fused qkv: one part for adapters.)
            if spec is not None and spec.dim == 0 and len(spec.names) > 1:
                offsets = [sum(p.size for p in spec.parts[:i]) for i in range(len(spec.parts))]
                parts = [(offset, p.size) for offset, p in zip(offsets, spec.parts, strict=True)]
            elif spec is None and len(shard_ids) > 1 and self.table.shards is not None:
                parts = sorted(self.table.shards(f"{name}.weight", shard) for shard in shard_ids)
            found[name] = (module, parts, spec is not None and spec.dim == 1)
        return found

    def add(self, lora: LoRARequest) -> AdapterInfo:
        """Read and check the adapter (again, where the one held by its name has another path or
        id); LoRAError where it cannot run on this model."""
        held = self.adapters.get(lora.lora_name)
        if held is None or held.request != lora:
            # Kept in host memory (as vLLM's CPU pool); a slot on the device takes a copy.
            cpu = torch.device("cpu")
            held = read_adapter(lora, self.model, self.table, self.vision, self.max_lora_rank, self.dtype, cpu)
            self._hook([name for name in held.modules if name not in self.layers])
            for name, delta in held.modules.items():
                if not self.layers[name].fits(delta):
                    raise LoRAError(
                        f"adapter {lora.lora_name!r} ({lora.lora_path}): its update of layer {name} covers outputs "
                        f"{[(o, s) for o, s, _, _ in delta.parts]}, the layer's parts are {self.layers[name].parts}"
                    )
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
        for name in list(self.adapters):
            if len(self.adapters) <= self.capacity:
                break
            if name != lora.lora_name:
                del self.adapters[name]
        return AdapterInfo(held.vision, held.nbytes, held.max_rank, len(held.modules))

    def _hook(self, names: list[str]) -> None:
        """Slots and a forward hook for layers no adapter changed before (zero in every slot: the
        adapters in them leave these layers alone)."""
        layers = self._linear_layers() if names else {}
        for name in names:
            module, parts, reduce = layers[name]
            layer = LoRALayer(
                name,
                self.rows,
                module.in_features,  # type: ignore[arg-type]
                parts,
                self.max_lora_rank,
                self.max_loras,
                reduce,
                self.dtype,
                self.device,
                self._op(),
            )
            module.register_forward_hook(layer)
            self.layers[name] = layer

    def _op(self) -> LinearOp:
        """The matrix product of the slots: on the CPU in bf16, the engine's per-shape choice for
        their shapes (every layer's, chosen once: a few milliseconds a shape), else torch's."""
        if self._slot_op is None:
            shapes = set()
            width = self.max_lora_rank * self.max_loras
            for module, parts, _ in self._linear_layers().values():
                shapes.add((width * len(parts), int(module.in_features)))  # type: ignore[arg-type]
                shapes |= {(size, width) for _, size in parts}
            self._slot_op = select_linear_op(self.device, self.dtype, shapes)
        return self._slot_op

    def remove(self, lora_name: str) -> None:
        self.adapters.pop(lora_name, None)

    def get(self, lora: LoRARequest) -> LoadedAdapter:
        held = self.adapters.get(lora.lora_name)
        if held is None or held.request != lora:
            self.add(lora)
            held = self.adapters[lora.lora_name]
        self.adapters.move_to_end(lora.lora_name)
        return held

    def _slot(self, adapter: LoadedAdapter, busy: set[int]) -> int:
        """The slot holding the adapter, copying it into one first where none does."""
        for slot, holder in enumerate(self.slots):
            if holder is adapter:
                return slot
        free = [s for s in range(self.max_loras) if s not in busy]
        if not free:
            raise LoRAError(f"a step with more than max_loras {self.max_loras} adapters")
        slot = min(free, key=lambda s: (self.slots[s] is not None, self.slot_last_used[s]))
        for name, layer in self.layers.items():
            layer.load(slot, adapter.modules.get(name))
        self.slots[slot] = adapter
        return slot

    def _slots_of(self, loras: Sequence[LoRARequest | None]) -> dict[LoRARequest, int]:
        self.steps += 1
        slots: dict[LoRARequest, int] = {}
        for lora in dict.fromkeys(lora for lora in loras if lora is not None):
            slots[lora] = self._slot(self.get(lora), set(slots.values()))
            self.slot_last_used[slots[lora]] = self.steps
        return slots

    @contextlib.contextmanager
    def step(
        self, loras: Sequence[LoRARequest | None], row_counts: Sequence[int], output_rows: Sequence[int] | None
    ) -> Iterator[None]:
        """The model's forward over a step whose sequence i has row_counts[i] rows and runs with
        loras[i] (None: the base model); output_rows: the rows kept past the last layer's
        attention (None: all)."""
        slots = self._slots_of(loras)
        per_row = [
            -1 if lora is None else slots[lora] for lora, n in zip(loras, row_counts, strict=True) for _ in range(n)
        ]
        by_count: dict[int | None, StepRows | None] = {len(per_row): step_rows(per_row, self.max_loras, self.device)}
        if output_rows is not None:
            kept = [per_row[i] for i in output_rows]
            by_count[len(output_rows)] = step_rows(kept, self.max_loras, self.device)
        with self.rows.use(by_count):
            yield

    @contextlib.contextmanager
    def encoding(self, lora: LoRARequest | None) -> Iterator[None]:
        """The vision tower's forward over images of one adapter's requests (None: the base's)."""
        if lora is None:
            yield
            return
        slot = self._slots_of([lora])[lora]
        rows = step_rows([slot], self.max_loras, self.device)
        with self.rows.use({None: rows}):
            yield
