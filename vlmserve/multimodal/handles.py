"""The int64 values inside token ids (the list-of-dicts input's shared-memory handles): what a
family writes after an item's segment handle.

Every value is far above any token id, so a prompt carrying them cannot be mistaken for a plain
one, and each says what it is:

    handle   1 << 61 | pid << 38 | id          the segment's name (vlmserve.ipc.shm)
    value    1 << 62 | kind << 60 | payload
      kind 0   an image's grid (t, h, w)        20 bits each: t << 40 | h << 20 | w
      kind 1   a video's grid (t, h, w)         the same
      kind 2   an array's shape, up to 4 dims   15 bits each, first dim highest; a shape of fewer
                                                dims is padded with zeros in front (no dim is 0)
      kind 3   seconds per temporal patch       the float32's bits (what M-RoPE computes with)

Where the values sit is the family's layout (its processing info); this module only encodes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

HANDLE_TAG = 1 << 61
VALUE_TAG = 1 << 62
_KIND_SHIFT = 60
IMAGE_GRID, VIDEO_GRID, SHAPE, SECONDS = 0, 1, 2, 3
_GRID_KINDS = {"image": IMAGE_GRID, "video": VIDEO_GRID}
_SHAPE_DIMS, _SHAPE_BITS = 4, 15


def is_handle(value: int) -> bool:
    """A segment handle's tag (its name is checked when it is decoded)."""
    return HANDLE_TAG <= value < VALUE_TAG


def handles_after(start_token_id: int, token_ids: Sequence[int]) -> list[int]:
    """Positions of the handles that follow a `start_token_id` (a family's span opener)."""
    return [p + 1 for p in range(len(token_ids) - 1) if token_ids[p] == start_token_id and is_handle(token_ids[p + 1])]


def _value(kind: int, payload: int) -> int:
    return VALUE_TAG | kind << _KIND_SHIFT | payload


def _payload(value: int, kind: int, what: str) -> int:
    if not VALUE_TAG <= value < 1 << 63 or (value >> _KIND_SHIFT) & 3 != kind:
        raise ValueError(f"token {value} is not an encoded {what}")
    return value & ((1 << _KIND_SHIFT) - 1)


def grid_to_int64(grid: tuple[int, int, int], modality: str = "image") -> int:
    t, h, w = grid
    if modality not in _GRID_KINDS:
        raise ValueError(f"no grid encoding for {modality!r}")
    if not (0 < t < 1 << 20 and 0 < h < 1 << 20 and 0 < w < 1 << 20):
        raise ValueError(f"grid {grid} does not fit a token")
    return _value(_GRID_KINDS[modality], t << 40 | h << 20 | w)


def int64_to_grid(value: int) -> tuple[str, tuple[int, int, int]]:
    """(modality, grid) of an encoded image or video grid."""
    kind = (value >> _KIND_SHIFT) & 3 if value >= VALUE_TAG else -1
    modality = next((m for m, k in _GRID_KINDS.items() if k == kind), None)
    if modality is None:
        raise ValueError(f"token {value} is not an encoded grid")
    body = _payload(value, kind, "grid")
    return modality, (body >> 40, (body >> 20) & 0xFFFFF, body & 0xFFFFF)


def shape_to_int64(shape: tuple[int, ...]) -> int:
    if not 0 < len(shape) <= _SHAPE_DIMS or not all(0 < d < 1 << _SHAPE_BITS for d in shape):
        raise ValueError(f"shape {shape} does not fit a token")
    payload = 0
    for dim in shape:
        payload = payload << _SHAPE_BITS | dim
    return _value(SHAPE, payload)


def int64_to_shape(value: int) -> tuple[int, ...]:
    body = _payload(value, SHAPE, "shape")
    dims = [(body >> (_SHAPE_BITS * k)) & ((1 << _SHAPE_BITS) - 1) for k in reversed(range(_SHAPE_DIMS))]
    while dims and dims[0] == 0:
        dims.pop(0)
    if not dims or 0 in dims:
        raise ValueError(f"token {value} is not an encoded shape")
    return tuple(dims)


def seconds_to_int64(seconds: float) -> int:
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds per temporal patch must be positive, got {seconds}")
    try:
        (bits,) = struct.unpack("<I", struct.pack("<f", seconds))
    except OverflowError:
        raise ValueError(f"{seconds} seconds per temporal patch do not fit a float32") from None
    return _value(SECONDS, bits)


def int64_to_seconds(value: int) -> float:
    body = _payload(value, SECONDS, "time")
    (seconds,) = struct.unpack("<f", struct.pack("<I", body & 0xFFFFFFFF))
    if body >> 32 or not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"token {value} is not an encoded time")
    return float(seconds)
