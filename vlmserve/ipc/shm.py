"""POSIX shared memory for pixels on their way from the API process to the engine (and in the
list-of-dicts input's handles).

One segment per image, named vlmserve-<pid>-<id>: <pid> is the process that created it, <id> 38
random bits. The engine unlinks a segment once it has copied it; whoever creates a segment
unlinks it if the engine never got it; and `sweep()` at start-up removes segments whose creator
has died (a crashed run), leaving those of live processes alone.

The list-of-dicts input carries segment handles inside token ids, so a name encodes to an int64 far above any
token id: 1 << 61 | pid << 38 | id (the values written after it, grids and shapes, are
vlmserve.multimodal.handles'). Every handle decodes to a name under our prefix, so a token id can
never point the engine at somebody else's segment.

A segment's space is reserved (posix_fallocate) before a byte is written: on a full /dev/shm
(Docker's default is 64 MiB) writing into a sparse segment raises SIGBUS and kills the process,
while a reservation fails cleanly. The bytes of this process's segments that exist at once are
bounded too (`set_max_bytes`, `vlmserve serve --max-shm-bytes`); over either, `write_array`
raises SharedMemoryFull: a 413 when the segment could never fit, a 503 when it could later.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import threading
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np

from vlmserve.errors import APIError
from vlmserve.multimodal.handles import HANDLE_TAG, is_handle

PREFIX = "vlmserve-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-([0-9a-f]+)$")
_ID_BITS = 38
SHM_DIR = Path("/dev/shm")


class ShmError(ValueError):
    """A segment is missing, malformed, or does not match what the request says."""


class SharedMemoryFull(APIError):
    """No room in /dev/shm (or under the configured total) for a request's pixels: 413 when the
    segment alone is over what could ever be had, 503 when it may fit once others are gone."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message, code="shared_memory_full")


# Bytes of this process's segments that may exist at once; None: half of /dev/shm's size.
_max_bytes: int | None = None
_lock = threading.Lock()


def set_max_bytes(limit: int | None) -> None:
    global _max_bytes
    if limit is not None and limit <= 0:
        raise ValueError(f"the shared-memory limit must be positive, got {limit}")
    _max_bytes = limit


def _filesystem() -> tuple[int, int]:
    """(size, free bytes) of the filesystem behind SHM_DIR."""
    st = os.statvfs(SHM_DIR)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def bytes_in_use(pid: int | None = None) -> int:
    """Bytes held by the segments `pid` (default: this process) created and nobody unlinked yet."""
    prefix = f"{PREFIX}{os.getpid() if pid is None else pid}-"
    total = 0
    for name in list_segments():
        if name.startswith(prefix):
            with contextlib.suppress(FileNotFoundError):  # the engine unlinked it meanwhile
                total += (SHM_DIR / name).stat().st_size
    return total


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _admit(nbytes: int) -> None:
    """Refuse a segment of `nbytes` that the configured total or /dev/shm's size cannot take."""
    size, _ = _filesystem()
    limit = size // 2 if _max_bytes is None else _max_bytes
    if nbytes > size:
        raise SharedMemoryFull(
            413,
            f"the request's pixels need {nbytes} bytes ({_mib(nbytes)}) of shared memory in one segment and "
            f"/dev/shm is {_mib(size)} in all; send a smaller image or lower max_pixels (a container needs a "
            "larger /dev/shm: docker run --shm-size)",
        )
    if nbytes > limit:
        raise SharedMemoryFull(
            413,
            f"the request's pixels need {nbytes} bytes ({_mib(nbytes)}) of shared memory in one segment, over the "
            f"server's {limit}-byte limit (--max-shm-bytes); send a smaller image or lower max_pixels",
        )
    used = bytes_in_use()
    if used + nbytes > limit:
        raise SharedMemoryFull(
            503,
            f"shared memory is busy: {used} bytes of pixels in flight and this request needs {nbytes} more, over "
            f"the {limit}-byte limit (--max-shm-bytes); retry later",
        )


def _reserve(name: str, nbytes: int) -> None:
    """Allocate a segment's pages now, so that a full /dev/shm fails here and not as SIGBUS on write."""
    fd = os.open(SHM_DIR / name, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        size, free = _filesystem()
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL) and free >= nbytes:
            return  # no fallocate on this filesystem: its free space is the best check there is
        raise SharedMemoryFull(
            413 if nbytes > size else 503,
            f"/dev/shm has {free} bytes ({_mib(free)}) free of {_mib(size)} and the request's pixels need {nbytes} "
            f"bytes ({_mib(nbytes)}); a container needs a larger /dev/shm (docker run --shm-size)",
        ) from None
    finally:
        os.close(fd)


def _untrack(shm: shared_memory.SharedMemory) -> None:
    # Python < 3.13 registers every segment it opens with the resource tracker, which unlinks
    # "leaked" ones at exit: ownership here is explicit, so take them off its books.
    with contextlib.suppress(Exception):  # the tracker is best effort
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


def new_name(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    if not 0 < pid < (1 << 22):
        raise ValueError(f"pid {pid} does not fit a segment handle")
    return f"{PREFIX}{pid}-{secrets.randbits(_ID_BITS):x}"


def name_to_handle(name: str) -> int:
    match = _NAME.match(name)
    if match is None:
        raise ShmError(f"not a vlmserve segment name: {name!r}")
    pid, ident = int(match.group(1)), int(match.group(2), 16)
    return HANDLE_TAG | (pid << _ID_BITS) | ident


def handle_to_name(handle: int) -> str:
    if not is_handle(handle):
        raise ShmError(f"token {handle} is not a segment handle")
    body = handle & ~HANDLE_TAG
    return f"{PREFIX}{body >> _ID_BITS}-{body & ((1 << _ID_BITS) - 1):x}"


@dataclass(frozen=True)
class Segment:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"


def write_array(array: np.ndarray) -> Segment:
    """Copy `array` into a new segment; the caller (or the engine) must unlink it. Raises
    SharedMemoryFull (nothing left behind) when the space cannot be had."""
    array = np.ascontiguousarray(array)
    nbytes = max(1, array.nbytes)
    with _lock:  # admission and reservation as one step, so two writers cannot both pass the check
        _admit(nbytes)
        name = new_name()
        shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        _untrack(shm)
        try:
            _reserve(name, nbytes)
        except BaseException:
            shm.close()
            unlink(name)  # not shm.unlink(): the resource tracker no longer knows the name
            raise
    try:
        np.ndarray(array.shape, dtype=array.dtype, buffer=shm.buf)[...] = array
    except BaseException:
        shm.close()
        unlink(name)
        raise
    shm.close()
    return Segment(name, tuple(array.shape), str(array.dtype))


def read_and_unlink(segment: Segment) -> np.ndarray:
    """Copy a segment's array out and remove the segment, whatever the outcome."""
    if _NAME.match(segment.name) is None:
        raise ShmError(f"not a vlmserve segment name: {segment.name!r}")
    try:
        shm = shared_memory.SharedMemory(name=segment.name, create=False)
    except FileNotFoundError:
        raise ShmError(f"shared memory segment {segment.name} is gone") from None
    _untrack(shm)
    try:
        dtype = np.dtype(segment.dtype)
        expected = int(np.prod(segment.shape)) * dtype.itemsize
        if shm.size < expected:
            raise ShmError(f"segment {segment.name} holds {shm.size} bytes, {expected} expected")
        return np.ndarray(segment.shape, dtype=dtype, buffer=shm.buf).copy()
    finally:
        shm.close()
        unlink(segment.name)


def unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SHM_DIR / name)


def list_segments() -> list[str]:
    try:
        return sorted(p.name for p in SHM_DIR.iterdir() if _NAME.match(p.name))
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> list[str]:
    """Remove segments whose creating process is gone; returns their names."""
    removed = []
    for name in list_segments():
        match = _NAME.match(name)
        assert match is not None
        if not _alive(int(match.group(1))):
            unlink(name)
            removed.append(name)
    return removed
