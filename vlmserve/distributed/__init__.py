"""Tensor parallelism on torch.distributed: the process group a worker joins, the collectives
the sharded layers call, and which shard this process holds. Without an initialised group every
function here answers as rank 0 of 1 and the collectives do nothing, so single-process code
paths are unchanged."""

from vlmserve.distributed.parallel_state import (
    TensorParallelGroup,
    all_gather,
    all_reduce,
    destroy_tensor_parallel,
    init_tensor_parallel,
    simulated_tensor_parallel,
    tp_group,
    tp_rank,
    tp_size,
)

__all__ = [
    "TensorParallelGroup",
    "all_gather",
    "all_reduce",
    "destroy_tensor_parallel",
    "init_tensor_parallel",
    "simulated_tensor_parallel",
    "tp_group",
    "tp_rank",
    "tp_size",
]
