"""The list-of-dicts input's contract: token ids that carry shared-memory handles (written by the API process's
vlmserve.api.list_format.tokenize). `decode(ids, info)` is the engine's side: it reads and
unlinks the segments, puts the placeholder ids back and returns the items; `release` unlinks
them for a request that never reaches the engine. Segments are released whatever happens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np

from vlmserve.ipc import shm
from vlmserve.multimodal.inputs import MultiModalItem
from vlmserve.processor.base import ProcessingInfo


def segment_names(ids: Sequence[int], info: ProcessingInfo) -> list[str]:
    """The segments the ids point at (handles that decode to no name are left out)."""
    names = []
    for p in info.handle_positions(ids):
        with contextlib.suppress(shm.ShmError):
            names.append(shm.handle_to_name(ids[p]))
    return names


def release(ids: Sequence[int], info: ProcessingInfo) -> None:
    """Unlink every segment the ids point at (ids that will never reach the engine)."""
    for name in segment_names(ids, info):
        shm.unlink(name)


def decode(ids: Sequence[int], info: ProcessingInfo) -> tuple[list[int], list[MultiModalItem]]:
    """The engine side: segments read (and unlinked), placeholders restored, items built by the
    family's layout (info.item_from_handle). Every segment the ids point at is gone afterwards,
    whether they decode or not."""
    positions = info.handle_positions(ids)
    try:
        names = [shm.handle_to_name(ids[p]) for p in positions]
    except shm.ShmError:
        release(ids, info)
        raise
    out = list(ids)
    items = []
    try:
        for p, name in zip(positions, names, strict=True):

            def read(shape: tuple[int, ...], name: str = name) -> np.ndarray:
                return shm.read_and_unlink(shm.Segment(name, shape))

            items.append(info.item_from_handle(out, p, read))
    finally:
        for name in names:
            shm.unlink(name)
    return out, items
