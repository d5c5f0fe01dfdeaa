"""Tensors whose last byte is the last readable one: a guard page follows, so a kernel that reads
past the end of its weights crashes instead of reading the next allocation's bytes (which
would not change a product whose activations are zero-padded there)."""

from __future__ import annotations

import ctypes
import mmap

import torch

_keep: list[mmap.mmap] = []  # the mappings live as long as the tests


def before_guard_page(t: torch.Tensor) -> torch.Tensor:
    """A copy of t (contiguous) ending right before an unreadable page."""
    nbytes = t.numel() * t.element_size()
    page = mmap.PAGESIZE
    size = (nbytes + page - 1) // page * page + page
    buf = mmap.mmap(-1, size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    _keep.append(buf)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mprotect(ctypes.c_void_p(address + size - page), ctypes.c_size_t(page), 0) != 0:  # PROT_NONE
        raise OSError(ctypes.get_errno(), "mprotect failed")
    out = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=size - page - nbytes)
    out = out.view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
