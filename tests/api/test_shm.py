"""Shared memory segments: real POSIX segments in /dev/shm."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from vlmserve.ipc import shm
from vlmserve.multimodal import handles


def test_round_trip_and_unlink() -> None:
    array = np.random.default_rng(0).standard_normal((37, 1176)).astype(np.float32)
    segment = shm.write_array(array)
    assert segment.name in shm.list_segments()
    assert segment.name.startswith(f"vlmserve-{__import__('os').getpid()}-")
    out = shm.read_and_unlink(segment)
    assert np.array_equal(out, array)
    assert segment.name not in shm.list_segments()
    with pytest.raises(shm.ShmError, match="is gone"):
        shm.read_and_unlink(segment)


def test_handles_encode_into_int64_above_every_token_id() -> None:
    name = shm.new_name()
    handle = shm.name_to_handle(name)
    assert 151936 < handle < 2**63
    assert shm.handle_to_name(handle) == name
    grid_value = handles.grid_to_int64((1, 28, 28))  # the values after a handle are never one
    for bad in (151655, -1, grid_value, handles.seconds_to_int64(1.0)):
        with pytest.raises(shm.ShmError):
            shm.handle_to_name(bad)
    with pytest.raises(shm.ShmError, match="not a vlmserve segment name"):
        shm.name_to_handle("psm_12345")


def test_reading_checks_the_size() -> None:
    segment = shm.write_array(np.zeros((4, 4), dtype=np.float32))
    with pytest.raises(shm.ShmError, match="holds 64 bytes, 128 expected"):
        shm.read_and_unlink(shm.Segment(segment.name, (8, 4), "float32"))
    assert segment.name not in shm.list_segments()  # unlinked even though the read failed


def test_sweep_removes_only_segments_of_dead_processes() -> None:
    # A child process creates a segment and dies without unlinking it: a crash.
    code = (
        "import numpy as np; from vlmserve.ipc import shm; print(shm.write_array(np.ones(16, dtype=np.float32)).name)"
    )
    orphan = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    mine = shm.write_array(np.ones(4, dtype=np.float32))
    assert orphan in shm.list_segments()
    removed = shm.sweep()
    assert orphan in removed and orphan not in shm.list_segments()
    assert mine.name in shm.list_segments()  # ours: this process is alive
    shm.unlink(mine.name)
