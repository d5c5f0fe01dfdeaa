"""AWQ and GPTQ checkpoints kept 4-bit in memory: the Linear layers whose checkpoint modules are all
packed become Int4Linear, loaded from the tensors quant/packed.py's int4_rows makes (one row per
output, so a fused qkv or gate_up takes its parts like float weights), then reordered once into
the blocked layout the kernels read (kernels/cpu_int4.c). A 2B decoder's weights take a quarter of
their bf16 bytes, and so does reading them in a decode step.

Where this applies (int4_applies): the CPU, tensor_parallel_size 1, groups of inputs in order
(not GPTQ's desc_act) of a multiple of 16 inputs, and cpu_int4.c built here. Elsewhere, and for
packed weights that are not a Linear layer's (stacked MoE experts), the checkpoint is dequantized
into the model's dtype as it loads (quant/packed.py), as before."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.kernels import LinearOp
from vlmserve.kernels.int4 import BLOCK, GROUP_MULTIPLE, Int4Kernel, int4_linear
from vlmserve.models.layers import Linear
from vlmserve.models.loader import WeightTable, resolve_name
from vlmserve.models.parallel import ShardSpec, spec_of
from vlmserve.models.quant.packed import PackedConfig


class Int4Linear(nn.Module):
    """y = x @ W.T + bias, W 4-bit with a scale and zero point per output and group of inputs."""

    uses_linear_op = True  # the float product of the many-row path (bind_linear_op binds it)
    op: LinearOp

    def __init__(
        self,
        out_features: int,
        in_features: int,
        group_size: int,
        kernel: Int4Kernel,
        bias: nn.Parameter | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        n, k = out_features, in_features
        self.out_features, self.in_features, self.group_size = n, k, group_size
        groups = k // group_size
        # As loaded (int4_rows): one row per output; `finalize` reorders them into blocks.
        self.qweight = nn.Parameter(torch.empty(n, k // 8, dtype=torch.int32, device=device), requires_grad=False)
        self.scales = nn.Parameter(torch.empty(n, groups, dtype=torch.float32, device=device), requires_grad=False)
        self.qzeros = nn.Parameter(torch.empty(n, groups, dtype=torch.float32, device=device), requires_grad=False)
        self.bias = bias
        self.op = F.linear
        self.kernel = kernel
        self.tp_shards: dict[str, ShardSpec] = {}
        self._desc: torch.Tensor | None = None
        self._desc_key = (0, 0)  # the addresses _desc holds

    @classmethod
    def replacing(cls, linear: Linear, group_size: int, kernel: Int4Kernel) -> Int4Linear:
        """The layer that takes `linear`'s place (its bias, op and how the loader fills a fused
        column-parallel layer's parts along the outputs; tp_size 1: the whole of each)."""
        layer = cls(linear.out_features, linear.in_features, group_size, kernel, linear.bias, linear.weight.device)
        layer.op = linear.op
        spec = spec_of(linear, "weight")
        if spec is not None and spec.dim == 0:
            layer.tp_shards = {"qweight": spec, "scales": spec, "qzeros": spec}
            bias_spec = spec_of(linear, "bias")
            if bias_spec is not None:
                layer.tp_shards["bias"] = bias_spec
        return layer

    @classmethod
    def from_rows(cls, rows: dict[str, torch.Tensor], group_size: int, kernel: Int4Kernel) -> Int4Linear:
        """A finalized layer from int4_rows' tensors (quant/packed.py)."""
        n, k8 = rows["qweight"].shape
        layer = cls(n, 8 * k8, group_size, kernel)
        for name in ("qweight", "scales", "qzeros"):
            getattr(layer, name).data.copy_(rows[name])
        layer.finalize()
        return layer

    def finalize(self) -> None:
        """The loaded rows -> cpu_int4.c's blocks of 16 outputs (zero rows past out_features)."""
        n, groups = self.scales.shape
        blocks = -(-n // BLOCK)
        pad = blocks * BLOCK - n
        rows = nn.functional.pad(self.qweight.data, (0, 0, 0, pad))
        # [blocks * 16, K / 8] -> [blocks, K / 8, 16]
        blocked = rows.reshape(blocks, BLOCK, -1).transpose(1, 2).contiguous()
        scales = nn.functional.pad(self.scales.data, (0, 0, 0, pad)).reshape(blocks, BLOCK, groups)
        zeros = nn.functional.pad(self.qzeros.data, (0, 0, 0, pad)).reshape(blocks, BLOCK, groups)
        params = torch.stack([scales, zeros], dim=2).permute(0, 3, 2, 1).contiguous()  # [blocks, groups, 2, 16]
        self.qweight = nn.Parameter(blocked, requires_grad=False)  # [blocks, K / 8, 16]
        del self.scales, self.qzeros
        self.params = nn.Parameter(params, requires_grad=False)  # [blocks, groups, (scale, zero), 16] fp32
        self._desc = None

    def desc(self) -> torch.Tensor:
        """int64 [3] (cpu_int4.c): the weights' and the parameters' addresses and the group size;
        made again if they moved (models/huge_pages.py moves them after the build)."""
        key = (self.qweight.data_ptr(), self.params.data_ptr())
        if self._desc is None or key != self._desc_key:
            self._desc = torch.tensor([*key, self.group_size], dtype=torch.int64)
            self._desc_key = key
        return self._desc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_linear(x, self.desc(), self.bias, self.out_features, self.kernel, self.op)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group_size}"


def int4_applies(config: PackedConfig, device: torch.device, tp_size: int) -> bool:
    return device.type == "cpu" and tp_size == 1 and not config.desc_act


def keep_packed(
    model: nn.Module, table: WeightTable, names: Iterable[str], config: PackedConfig, kernel: Int4Kernel
) -> frozenset[str]:
    """Replace by Int4Linear each Linear layer of `model` whose checkpoint modules (from the
    checkpoint's tensor `names`) are all packed and whose shape the kernels take; the checkpoint
    module names whose tensors are to be loaded packed (quant/packed.py's `kept_packed`)."""
    sources: dict[str, dict[str, bool]] = {}  # our module -> its checkpoint modules -> packed?
    for name in names:
        module, _, suffix = name.rpartition(".")
        if suffix not in ("weight", "qweight"):
            continue
        ours, _, _ = resolve_name(f"{module}.weight", table)
        packed = sources.setdefault(ours.rpartition(".")[0], {})
        packed[module] = packed.get(module, False) or suffix == "qweight"
    kept: set[str] = set()
    for owner, parts in sources.items():
        if not all(parts.values()):
            continue
        try:
            linear = model.get_submodule(owner)
        except AttributeError:
            continue
        if not isinstance(linear, Linear):
            continue
        k = linear.in_features
        group = config.group_size if config.group_size > 0 else k
        if group % GROUP_MULTIPLE or k % group:
            continue
        parent, _, child = owner.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, Int4Linear.replacing(linear, group, kernel))
        kept.update(parts)
    return frozenset(kept)


def finalize_int4(model: nn.Module) -> int:
    """Reorder every Int4Linear's loaded rows into blocks; how many there were."""
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    for layer in layers:
        layer.finalize()
    return len(layers)
