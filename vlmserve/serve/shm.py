"""POSIX shared memory for pixels on their way from the API process to the engine (seed 004).

One segment per image, named vlmserve-<pid>-<id>: <pid> is the process that created it, <id> 38
random bits. The engine unlinks a segment once it has copied it; whoever creates a segment
unlinks it if the engine never got it; and `sweep()` at start-up removes segments whose creator
has died (a crashed run), leaving those of live processes alone.

Seed 004 carries segment handles inside token ids, so names and shapes encode to int64 values
far above any token id: a handle is 1 << 61 | pid << 38 | id, and a grid (t, h, w) is
1 << 62 | t << 40 | h << 20 | w. Every handle decodes to a name under our prefix, so a token
id can never point the engine at somebody else's segment.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np

PREFIX = "vlmserve-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-([0-9a-f]+)$")
_HANDLE_TAG = 1 << 61
_GRID_TAG = 1 << 62
_ID_BITS = 38
SHM_DIR = Path("/dev/shm")


class ShmError(ValueError):
    """A segment is missing, malformed, or does not match what the request says."""


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
    return _HANDLE_TAG | (pid << _ID_BITS) | ident


def handle_to_name(handle: int) -> str:
    if handle < 0 or not handle & _HANDLE_TAG or handle >= _GRID_TAG:
        raise ShmError(f"token {handle} is not a segment handle")
    body = handle & ~_HANDLE_TAG
    return f"{PREFIX}{body >> _ID_BITS}-{body & ((1 << _ID_BITS) - 1):x}"


def grid_to_int64(grid: tuple[int, int, int]) -> int:
    t, h, w = grid
    if not (0 < t < 1 << 20 and 0 < h < 1 << 20 and 0 < w < 1 << 20):
        raise ValueError(f"grid {grid} does not fit a token")
    return _GRID_TAG | t << 40 | h << 20 | w


def int64_to_grid(value: int) -> tuple[int, int, int]:
    if value < 0 or not value & _GRID_TAG:
        raise ShmError(f"token {value} is not an encoded grid")
    body = value & ~_GRID_TAG
    return body >> 40, (body >> 20) & 0xFFFFF, body & 0xFFFFF


@dataclass(frozen=True)
class Segment:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"


def write_array(array: np.ndarray) -> Segment:
    """Copy `array` into a new segment; the caller (or the engine) must unlink it."""
    array = np.ascontiguousarray(array)
    name = new_name()
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(1, array.nbytes))
    _untrack(shm)
    try:
        np.ndarray(array.shape, dtype=array.dtype, buffer=shm.buf)[...] = array
    except BaseException:
        shm.close()
        shm.unlink()
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
