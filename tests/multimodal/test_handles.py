"""The shared-memory handles' values inside token ids: exact encodings, and each kind refused where
another is expected."""

from __future__ import annotations

import numpy as np
import pytest

from vlmserve.multimodal import handles

VOCAB = 151936  # the largest Qwen vocabulary: every value must lie above every token id


def test_the_seed_example_shape_encodes_to_one_exact_int64() -> None:
    # Qwen-VL-Chat's pixels as the contract's tokenize() stores them: image_pixel[None, :] of [3, 448, 448].
    value = handles.shape_to_int64((1, 3, 448, 448))
    assert value == 0x6000_2000_C0E0_01C0 == 1 << 62 | 2 << 60 | 1 << 45 | 3 << 30 | 448 << 15 | 448
    assert handles.int64_to_shape(value) == (1, 3, 448, 448)
    assert handles.int64_to_shape(handles.shape_to_int64((37, 1176))) == (37, 1176)  # fewer dims: zeros in front


def test_grids_carry_their_modality_and_images_keep_the_old_encoding() -> None:
    image = handles.grid_to_int64((1, 8, 10))
    assert image == 1 << 62 | 1 << 40 | 8 << 20 | 10  # what tokenize wrote for images before videos came
    video = handles.grid_to_int64((2, 20, 28), "video")
    assert video == 1 << 62 | 1 << 60 | 2 << 40 | 20 << 20 | 28
    assert handles.int64_to_grid(image) == ("image", (1, 8, 10))
    assert handles.int64_to_grid(video) == ("video", (2, 20, 28))


def test_seconds_round_trip_as_the_float32_mrope_computes_with() -> None:
    for seconds in (1.0, 0.625, 2 / 3.2, 1001 / 15000):
        value = handles.int64_to_seconds(handles.seconds_to_int64(seconds))
        assert value == float(np.float32(seconds))
    assert handles.seconds_to_int64(0.625) == 1 << 62 | 3 << 60 | 0x3F20_0000


def test_every_value_is_above_the_vocabulary_and_no_kind_reads_as_another() -> None:
    values = {
        "image grid": handles.grid_to_int64((1, 2, 2)),
        "video grid": handles.grid_to_int64((1, 2, 2), "video"),
        "shape": handles.shape_to_int64((1, 3, 448, 448)),
        "seconds": handles.seconds_to_int64(1.0),
    }
    for name, value in values.items():
        assert VOCAB < value < 2**63 and not handles.is_handle(value), name
    with pytest.raises(ValueError, match="not an encoded shape"):
        handles.int64_to_shape(values["image grid"])
    with pytest.raises(ValueError, match="not an encoded grid"):
        handles.int64_to_grid(values["shape"])
    with pytest.raises(ValueError, match="not an encoded time"):
        handles.int64_to_seconds(values["video grid"])
    for bad in (151655, -1, handles.HANDLE_TAG | 5):
        with pytest.raises(ValueError):
            handles.int64_to_grid(bad)
    with pytest.raises(ValueError, match="does not fit"):
        handles.shape_to_int64((1, 3, 448, 448, 1))
    with pytest.raises(ValueError, match="does not fit"):
        handles.shape_to_int64((1 << 15,))
    with pytest.raises(ValueError, match="positive"):
        handles.seconds_to_int64(0.0)


def test_handles_are_found_only_right_after_the_span_opener() -> None:
    h = handles.HANDLE_TAG | 7
    ids = [1, 9, h, 5, h, 9, 9, h]
    assert handles.handles_after(9, ids) == [2, 7]
