"""Memory the API process frees goes back to the system (glibc's malloc).

Decoding and resizing a large image allocates buffers of tens to hundreds of MB in worker
threads. glibc serves a freed buffer under its dynamic mmap threshold (which rises to 32 MiB
after the first large free) from per-thread heaps and keeps the pages: after 8 concurrent
8192x8192 PNGs the API process held ~300 MB more than before, after rounds of 4 concurrent
4000x4000 JPEGs its heap grew by 150, 220, 330 MB (docs/security.md, `python -m
vlmserve.bench.api_memory`). A fixed threshold of 1 MiB maps every buffer of 1 MiB or more on its
own and unmaps it when freed; the measured cost is ~7% more CPU time per image processed (page
faults on fresh pages), the gain that the process returns to its idle size after every burst.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 1 << 20


def return_freed_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Have malloc map allocations of `threshold` bytes or more on their own (returned to the
    system when freed). True where it took effect (glibc); elsewhere nothing changes."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the interpreter runs on
    except (OSError, AttributeError):  # one without mallopt
        return False
    done = bool(mallopt(M_MMAP_THRESHOLD, threshold))
    if not done:
        logger.debug("mallopt(M_MMAP_THRESHOLD) refused; freed memory may stay with the process")
    return done
