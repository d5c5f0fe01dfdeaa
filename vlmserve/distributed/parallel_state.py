"""The tensor-parallel group of this process (one per process: a worker is one rank).

NCCL on CUDA, gloo on the CPU, for the model's collectives; control messages (the scheduler's
output, broadcast from rank 0) always go over a gloo group, which carries CPU tensors whatever
the device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    size: int
    # None when size == 1 (no process group at all).
    device_group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None


_SINGLE = TensorParallelGroup(rank=0, size=1, device_group=None, cpu_group=None)
_group: TensorParallelGroup = _SINGLE


def init_tensor_parallel(
    rank: int,
    world_size: int,
    device: torch.device,
    init_method: str = "env://",
    timeout_s: float = 600.0,
) -> TensorParallelGroup:
    """Join the group: every rank of the world is one tensor-parallel shard. `init_method` is
    torch.distributed's (env:// reads MASTER_ADDR / MASTER_PORT; tcp://host:port)."""
    global _group
    if world_size == 1:
        _group = _SINGLE
        return _group
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    device_group = dist.group.WORLD
    cpu_group = device_group if backend == "gloo" else dist.new_group(backend="gloo")
    _group = TensorParallelGroup(rank=rank, size=world_size, device_group=device_group, cpu_group=cpu_group)
    return _group


def destroy_tensor_parallel() -> None:
    global _group
    if _group.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _group = _SINGLE


def tp_group() -> TensorParallelGroup:
    return _group


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks (in place; returned for chaining). Identity at size 1."""
    if _group.size > 1:
        dist.all_reduce(x, group=_group.device_group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' x concatenated along `dim`, rank 0 first. Identity at size 1."""
    if _group.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_group.size)]
    dist.all_gather(parts, x.contiguous(), group=_group.device_group)
    return torch.cat(parts, dim=dim)


@contextlib.contextmanager
def simulated_tensor_parallel(rank: int, size: int) -> Iterator[TensorParallelGroup]:
    """Answer as rank `rank` of `size` with no process group, for building a model's shard (on
    the meta device, to count what each rank would hold) only: a collective run under it fails."""
    global _group
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is not in 0..{size - 1}")
    previous = _group
    _group = TensorParallelGroup(rank=rank, size=size, device_group=None, cpu_group=None)
    try:
        yield _group
    finally:
        _group = previous
