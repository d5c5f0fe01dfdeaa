"""A CPU model's weights moved into memory backed by transparent huge pages (2 MiB), when the
kernel offers them.

Why: a decode step streams every weight once. With 4 KiB pages that is a TLB miss every 4 KiB,
and the CPU's prefetchers stop at each 4 KiB page boundary. Measured on the 2-core Zen 4 machine of
docs/benchmarks.md ("Weights on huge pages": [rows, 1536] x [151936, 1536] bf16, 2 threads,
same run): vlmserve's AVX-512 kernel 1 row 13.4 -> 13.3 ms, 2 rows 14.3 -> 13.4, 8 rows
14.6 -> 13.3, 32 rows 50.3 -> 48.4; torch's oneDNN linear 3-7 % faster too.

Linux gives huge pages to anonymous memory that asks for them (madvise(MADV_HUGEPAGE)) when
/sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise", the common defaults; torch's
own allocator asks only under the environment variable THP_MEM_ALLOC_ENABLE, read once at its
first allocation, too early for a library to set. So the weights, once loaded (and quantized),
are copied into one mapping that asks, a tensor at a time (at most one extra tensor resident).
Tensors sharing memory (tied embeddings and lm_head) keep sharing it.

The cost is at start-up: the kernel must find free 2 MiB blocks. On the test VM, whose free
memory is handed back to the host in large blocks, it took 4.4-5.1 s for the 2B model's 4.1 GiB
(start-up 7.3 -> 10.8-12.0 s) and ~1 s for the benchmark-size 0.8 GiB; on memory the kernel
already holds it runs at copy speed. The time is logged.

Weights reordered for oneDNN (models/prepack.py) live in oneDNN's own memory, which cannot be
moved; where the kernel has MADV_COLLAPSE (Linux 6.1+) their memory is collapsed into huge pages in
place. vlmserve's kernel on such a weight ([17920, 1536] bf16, one row, eight matrices in turn so
none stays in the caches, Zen 4, 2 threads): 2.10-2.33 ms on 4 KiB pages, 1.78-2.04 on huge pages.

VLMSERVE_HUGE_PAGES=0 turns it off (for comparisons).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from vlmserve.kernels.onednn import packed_linear, weight_address, weight_nbytes
from vlmserve.models.layers import Linear
from vlmserve.progress import waiting

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# Smaller tensors (norms, biases, scales) are read from cache; they stay where they are.
MIN_BYTES = 256 << 10
_ALIGN = 4096
_MADV_COLLAPSE = 25  # <linux/mman.h>, Linux 6.1
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether this process can map anonymous memory on transparent huge pages by asking."""
    if os.environ.get("VLMSERVE_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = _THP_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting


def _storage_groups(model: nn.Module) -> dict[int, list[torch.Tensor]]:
    """The model's CPU parameters and buffers of at least MIN_BYTES, grouped by the memory they
    live in (one entry per storage, every tensor that views it)."""
    groups: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen or tensor.device.type != "cpu" or tensor.is_mkldnn:  # oneDNN's own memory
            continue
        seen.add(id(tensor))
        storage = tensor.untyped_storage()
        if storage.nbytes() >= MIN_BYTES:
            groups.setdefault(storage.data_ptr(), []).append(tensor)
    return groups


def _collapse_onednn_weights(model: nn.Module) -> int:
    """Ask the kernel to back the 2 MiB-aligned stretches of the decoder's oneDNN weights (those
    decode streams; the vision tower's products are compute-bound) with huge pages now: madvise
    MADV_HUGEPAGE, then MADV_COLLAPSE, which copies them into huge pages. The bytes collapsed, 0
    where the kernel cannot."""
    if sys.platform != "linux":
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    stretches = []
    for tensor in (m.weight for m in model.modules() if isinstance(m, Linear) and m.op is packed_linear):
        address, nbytes = weight_address(tensor), weight_nbytes(tensor)
        lo, hi = -(-address // HUGE_PAGE) * HUGE_PAGE, (address + nbytes) // HUGE_PAGE * HUGE_PAGE
        if hi - lo >= HUGE_PAGE:
            stretches.append((lo, hi))
    if not stretches:
        return 0
    total = 0
    with waiting("copying oneDNN's weights into huge pages", logger):  # seconds for a 2B
        for lo, hi in stretches:
            if madvise(lo, hi - lo, mmap.MADV_HUGEPAGE) or madvise(lo, hi - lo, _MADV_COLLAPSE):
                logger.debug("no huge pages for oneDNN's weights: madvise failed (errno %d)", ctypes.get_errno())
                break
            total += hi - lo
    return total


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def move_to_huge_pages(model: nn.Module) -> int:
    """Copy the model's large CPU tensors into one huge-page mapping (and collapse oneDNN's weights
    into huge pages in place); the bytes moved (0 when the kernel offers no huge pages)."""
    if not huge_pages_available():
        return 0
    start = time.perf_counter()
    collapsed = _collapse_onednn_weights(model)
    if collapsed:
        logger.info(
            "oneDNN's weights on huge pages: %.2f GiB collapsed in %.1f s",
            collapsed / (1 << 30),
            time.perf_counter() - start,
        )
    # NOTE: only the tensors are held, not their storages: each old storage is freed as soon as its
    # tensors view the new place, so at most one extra tensor's memory is resident.
    groups = list(_storage_groups(model).values())
    total = sum(_padded(tensors[0].untyped_storage().nbytes()) for tensors in groups)
    if total == 0:
        return 0
    start = time.perf_counter()
    # Anonymous and private: Linux backs a mapping with huge pages only on the 2 MiB-aligned
    # stretches inside it, so the tensors start at the first aligned address.
    arena = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(arena, dtype=torch.uint8)  # keeps the mapping alive while any view does
    offset = -whole.data_ptr() % HUGE_PAGE
    with torch.no_grad():
        for tensors in groups:
            old = tensors[0].untyped_storage()
            nbytes = old.nbytes()
            whole[offset : offset + nbytes].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
            del old
            for tensor in tensors:
                # the same view (offset, shape, strides, in elements) of the memory's new place
                first = offset // tensor.element_size() + tensor.storage_offset()
                moved = torch.empty(0, dtype=tensor.dtype).set_(
                    whole.untyped_storage(), first, tensor.size(), tensor.stride()
                )
                tensor.data = moved
            offset += _padded(nbytes)
    logger.info(
        "weights on huge pages: %.2f GiB in %d storages, moved in %.1f s",
        total / (1 << 30),
        len(groups),
        time.perf_counter() - start,
    )
    return total
