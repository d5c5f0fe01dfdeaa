"""Memory planning (vLLM's way): size the KV cache from what a memory budget leaves after the
weights, the encoder cache, and the peak activation memory of a worst-case step.

The worst case is measured, not estimated: the model runs dummy inputs of the largest size the
configuration admits (images of the most placeholder tokens per item, a full token budget of
prompt at the end of a max_model_len context, max_num_seqs sequences decoding at full length)
while a meter records peak memory. Everything a real step can do is bounded by those same
limits (the scheduler's budgets, the processor's per-item cap, the attention backend's decode
workspace), so a request that fits the plan cannot run the process out of memory later; one
that cannot fit is refused when submitted.

A model with per-request state (linear-attention layers) also needs max_num_seqs state slots of
a fixed size (vlmserve.attention.state), twice that with prefix caching (saved states); they are
set aside before the KV cache is sized.

Structured outputs' compiled grammars (engine/grammar_cache.py) live in the engine process's host
memory, up to their cache's size: on the CPU they share it with the KV cache and are set aside
before it is sized too; on CUDA the plan shows them, outside the device's budget.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import resource
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

GiB = 1 << 30


def _proc_status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _release_free_heap() -> None:
    """Give the C heap's free pages back to the kernel (glibc's malloc_trim), so that RSS counts
    only memory in use. Without it, memory freed earlier in the process (an earlier engine, an
    earlier test) stays resident inside the heap; a later allocation reuses it without growing
    RSS, and a peak measured as RSS growth misses it (it read 0 bytes for a whole profile step)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL(name).malloc_trim(0)


class PeakMeter:
    """Peak memory of this process on one device, resettable.

    On the CPU it is the resident set: the kernel's high-water mark (VmHWM) since the last reset,
    which the reset sets to the current RSS after the heap's free pages went back to the kernel."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        _release_free_heap()
        with contextlib.suppress(OSError):  # Linux: "5" resets VmHWM to the current RSS
            Path("/proc/self/clear_refs").write_text("5")

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        rss = _proc_status_kib("VmRSS")
        return (rss or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        hwm = _proc_status_kib("VmHWM")
        return (hwm or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def default_budget(device: torch.device, gpu_memory_utilization: float = 0.9) -> int:
    """CUDA: gpu_memory_utilization of the device (vLLM's name and default), less what is held
    there outside this process's torch allocator (the CUDA context and libraries' workspaces,
    other processes): the plan counts weights, activations and caches in allocator bytes.
    CPU: half of the memory available when the engine starts."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        outside_torch = max(0, total - free - torch.cuda.memory_reserved(device))
        budget = int(gpu_memory_utilization * total) - outside_torch
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization {gpu_memory_utilization} gives {gpu_memory_utilization * total / GiB:.2f} GiB "
                f"of the device's {total / GiB:.2f} GiB, and {outside_torch / GiB:.2f} GiB of it is already in use "
                "(CUDA context, other processes); raise gpu_memory_utilization"
            )
        return budget
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // 2
    except OSError:
        pass
    return 8 * GiB


@contextlib.contextmanager
def one_block_per_stack(model: nn.Module) -> Iterator[None]:
    """Run the model with each layer stack cut to its first layer.

    In inference the activations of one layer are freed before the next runs, so a stack's peak
    is one layer's peak: profiling one layer of each stack measures the same peak in a fraction
    of the time (the difference is a layer's worth of small temporaries at most)."""
    stacks = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.ModuleList) and len(child) > 1
    ]
    for parent, name, child in stacks:
        setattr(parent, name, nn.ModuleList([child[0]]))
    try:
        yield
    finally:
        for parent, name, child in stacks:
            setattr(parent, name, child)


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int
    weights_bytes: int
    activation_bytes: int  # measured peak of the worst-case step (0 when not profiled)
    encoder_cache_bytes: int
    block_bytes: int  # one KV block, all layers
    num_blocks: int
    block_size: int
    capped: bool  # KV limited to what max_num_seqs full-length sequences can use
    profiled: bool
    # max_num_seqs state slots, twice that with prefix caching (0 for a model without per-request state)
    state_cache_bytes: int = 0
    # Compiled grammars (structured outputs), in host memory: within the budget where the KV cache
    # is in host memory too (the CPU), beside it otherwise.
    grammar_cache_bytes: int = 0
    grammar_cache_in_budget: bool = True

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def describe(self) -> str:
        def g(n: int) -> str:
            return f"{n / GiB:.2f} GiB"

        source = "measured worst-case step" if self.profiled else "not profiled (KV size given)"
        cap = ", capped at max_num_seqs x max_model_len" if self.capped else ""
        state = f", per-request state {g(self.state_cache_bytes)}" if self.state_cache_bytes else ""
        grammars = f", grammar cache {g(self.grammar_cache_bytes)}" if self.grammar_cache_in_budget else ""
        host = "" if self.grammar_cache_in_budget else f"; grammar cache {g(self.grammar_cache_bytes)} in host memory"
        return (
            f"memory plan: budget {g(self.budget_bytes)}; weights {g(self.weights_bytes)}, activations "
            f"{g(self.activation_bytes)} ({source}), encoder cache {g(self.encoder_cache_bytes)}{state}{grammars}, "
            f"KV cache {g(self.kv_bytes)} = {self.num_blocks} blocks x {self.block_size} tokens = "
            f"{self.num_blocks * self.block_size} tokens{cap}{host}"
        )


def plan_kv_cache(
    *,
    budget_bytes: int,
    weights_bytes: int,
    activation_bytes: int,
    encoder_cache_bytes: int,
    block_bytes: int,
    block_size: int,
    min_blocks: int,
    max_useful_blocks: int,
    profiled: bool = True,
    state_cache_bytes: int = 0,
    grammar_cache_bytes: int = 0,
    grammar_cache_in_budget: bool = True,
) -> MemoryPlan:
    """Blocks that fit what the budget leaves; at least enough for one full-length sequence."""
    grammars = grammar_cache_bytes if grammar_cache_in_budget else 0
    left = budget_bytes - weights_bytes - activation_bytes - encoder_cache_bytes - state_cache_bytes - grammars
    fit = max(0, left) // block_bytes
    if fit < min_blocks:
        state = (
            f" + per-request state {state_cache_bytes / GiB:.2f} GiB (max_num_seqs slots)" if state_cache_bytes else ""
        )
        state += f" + grammar cache {grammars / GiB:.2f} GiB (--grammar-cache-gib)" if grammars else ""
        raise ValueError(
            f"memory budget of {budget_bytes / GiB:.2f} GiB is too small: weights {weights_bytes / GiB:.2f} GiB + "
            f"peak activations {activation_bytes / GiB:.2f} GiB + encoder cache {encoder_cache_bytes / GiB:.2f} GiB"
            f"{state} leave {max(0, left) / GiB:.2f} GiB for the KV cache, which needs at least {min_blocks} blocks "
            f"({min_blocks * block_bytes / GiB:.2f} GiB) to hold one max_model_len sequence; raise the budget or "
            f"lower max_model_len, max_num_batched_tokens{', max_num_seqs' if state_cache_bytes else ''} or max_pixels"
        )
    num_blocks = min(fit, max_useful_blocks)
    return MemoryPlan(
        budget_bytes=budget_bytes,
        weights_bytes=weights_bytes,
        activation_bytes=activation_bytes,
        encoder_cache_bytes=encoder_cache_bytes,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        block_size=block_size,
        capped=num_blocks < fit,
        profiled=profiled,
        state_cache_bytes=state_cache_bytes,
        grammar_cache_bytes=grammar_cache_bytes,
        grammar_cache_in_budget=grammar_cache_in_budget,
    )
