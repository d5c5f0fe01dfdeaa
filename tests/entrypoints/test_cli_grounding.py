"""`vlmserve chat --draw-boxes` as a user runs it. A random-weight model writes no boxes, so this
checks the plumbing (sizes from the engine output, the PNG written); what is printed for real
boxes is tests/test_grounding.py's test_format_boxes_is_what_the_cli_prints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from tests.entrypoints.test_cli import SUNSET, vlmserve


def test_draw_boxes_writes_the_png_and_says_how_many(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "boxes.png"
    result = vlmserve(
        "chat",
        str(tiny_dir),
        "--image",
        str(SUNSET),
        "Outline the sun.",
        "--draw-boxes",
        str(out),
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--dtype",
        "float32",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # sunset.png is 320 x 200; smart_resize makes it 308 x 196.
    assert lines[-2] == "0 boxes in original image pixels (320x200; the model saw 308x196)"
    assert lines[-1] == f"wrote the image with 0 boxes drawn to {out}"
    with Image.open(out) as drawn, Image.open(SUNSET) as original:
        assert drawn.format == "PNG" and drawn.size == original.size
        assert np.array_equal(np.asarray(drawn.convert("RGB")), np.asarray(original.convert("RGB")))


def test_draw_boxes_needs_an_image(tiny_dir: Path, tmp_path: Path) -> None:
    result = vlmserve("chat", str(tiny_dir), "hi", "--draw-boxes", str(tmp_path / "x.png"))
    assert result.returncode == 2
    assert result.stderr.strip() == "vlmserve chat: error: --draw-boxes needs an --image to draw on"
    assert not (tmp_path / "x.png").exists()
