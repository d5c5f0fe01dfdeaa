"""Grounding boxes from generated text, mapped to the pixels of the image the user sent.

Each model family writes boxes its own way, and says how in its entry (vlmserve/family.py's
ModelFamily.grounding, a GroundingConvention; vlmserve.registry finds one by name or by model):
  - its tagged syntax, if it has one: Qwen-VL-Chat's `<ref>dog</ref><box>(x1,y1),(x2,y2)</box>`,
    or the special tokens of the Qwen2 vocabulary,
    `<|object_ref_start|>dog<|object_ref_end|><|box_start|>(x1,y1),(x2,y2)<|box_end|>` (in the
    text only when decoded with skip_special_tokens=False);
  - its scale: "normalized", 0..1000 of the original image's width and height (Qwen-VL-Chat,
    Qwen2-VL, Qwen3-VL), or "resized_pixels", absolute pixels of the RESIZED image, the one
    smart_resize made and the model saw (Qwen2.5-VL).
JSON answers ([{"bbox_2d": [x1, y1, x2, y2], "label": "dog"}] or {"point_2d": [x, y]}) are read
in every convention. 0..1000 maps as x * original_w / 1000, absolute as x * original_w /
resized_w. The processor records both sizes per image (RequestOutput.mm_items; the server's
`vlmserve.mm_items`).

Worked example: Qwen-VL-Chat answers `<ref>击掌</ref><box>(517,508),(589,611)</box>`
about a 2048 x 1365 photo: x1 = 517 / 1000 * 2048 = 1058.8, y1 = 508 / 1000 * 1365 = 693.4.

What comes back is what the text says, made safe to draw, with what was changed said:
  - corners given as (right, bottom), (left, top) are put in order: `swapped`;
  - a box reaching past the image is clamped to [0, w] x [0, h]: `clamped`, with the values
    before clamping in `unclamped`;
  - a box of zero width or height (after clamping: e.g. one wholly outside the image) is KEPT and
    flagged `degenerate`, so a caller sees that the model pointed somewhere, and drops it if it likes.
Whatever cannot be parsed (malformed or truncated JSON, a box without its end tag, a wrong number
of coordinates) is skipped; parsing never raises on model output.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from PIL import Image, ImageDraw, ImageFont

NORMALIZED_SCALE = 1000.0  # the 0..1000 conventions


@dataclass(frozen=True)
class BoxTags:
    """A tagged syntax: the strings that open and close a label (ref), a box and a quadrilateral."""

    ref: tuple[str, str]
    box: tuple[str, str]
    quad: tuple[str, str]


@dataclass(frozen=True)
class GroundingConvention:
    """How a model family writes boxes; its entry (vlmserve/family.py) carries it."""

    name: str  # what the server's `vlmserve.grounding_convention` and `--box-convention` call it
    # "normalized": 0..1000 of the original image's width and height; "resized_pixels": pixels of
    # the image as resized for the model.
    coordinates: Literal["normalized", "resized_pixels"]
    tags: BoxTags | None = None  # its tagged syntax (JSON is read in every convention)

    @property
    def scale(self) -> str:
        """The coordinates in words: "on a 0..1000 scale" or "in the resized image's pixels"."""
        return "on a 0..1000 scale" if self.coordinates == "normalized" else "in the resized image's pixels"


@dataclass(frozen=True)
class RawBox:
    """A box or point as written in the text, before any mapping."""

    label: str | None
    values: tuple[float, ...]  # (x1, y1, x2, y2) for a box, (x, y) for a point, 4 corners for a quad
    kind: Literal["box", "point", "quad"]
    start: int  # where in the text it was found


@dataclass(frozen=True)
class Box:
    """A box in the ORIGINAL image's pixels: 0 <= x1 <= x2 <= width, 0 <= y1 <= y2 <= height.
    A point has x1 == x2 and y1 == y2. A quadrilateral (<quad>, <|quad_start|>: text regions)
    keeps its four corners in `corners` (clamped like the rest); x1..y2 enclose them."""

    label: str | None
    x1: float
    y1: float
    x2: float
    y2: float
    convention: str  # the GroundingConvention's name
    raw: tuple[float, ...]  # the numbers as the model wrote them
    kind: Literal["box", "point", "quad"] = "box"
    clamped: bool = False  # reached past the image and was cut to it
    unclamped: tuple[float, float, float, float] | None = None  # mapped values before clamping, when clamped
    swapped: bool = False  # corners were out of order
    degenerate: bool = False  # a box (not a point) of zero width or height
    corners: tuple[tuple[float, float], ...] | None = None  # a quad's four corners, in writing order

    @property
    def xyxy(self) -> tuple[float, float, float, float]:
        return (self.x1, self.y1, self.x2, self.y2)


# -- finding boxes in text ------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# Between a ref and its boxes, or between two boxes of one ref, only separators may stand.
_SEPARATOR = re.compile(r"[\s,;，、]*")
_BOX_KEYS = ("bbox_2d", "bbox")
_POINT_KEYS = ("point_2d",)
_LABEL_KEYS = ("label", "text_content", "name", "text")
# Fallback for JSON that does not parse (single quotes, missing commas, cut short inside another
# object): a coordinate key with a flat list of numbers.
_LOOSE_COORDS = re.compile(r"""["']?(bbox_2d|bbox|point_2d)["']?\s*:\s*\[([^\[\]{}]*)\]""")
_LOOSE_LABEL = re.compile(r"""["']?(?:label|text_content|name|text)["']?\s*:\s*["']([^"'\n]*)["']""")


def find_boxes(text: str, tags: Sequence[BoxTags] = ()) -> list[RawBox]:
    """Every box and point in `text`, in the order written: in JSON, and in each tagged syntax of `tags`."""
    found = [box for syntax in tags for box in _find_tagged(text, syntax)]
    return sorted([*found, *_find_json(text)], key=lambda b: b.start)


def _tag_pattern(tags: BoxTags) -> re.Pattern[str]:
    (rs, re_), (bs, be), (qs, qe) = tags.ref, tags.box, tags.quad
    return re.compile(
        rf"{re.escape(rs)}(?P<ref>.*?){re.escape(re_)}|{re.escape(bs)}(?P<box>.*?){re.escape(be)}"
        rf"|{re.escape(qs)}(?P<quad>.*?){re.escape(qe)}",
        re.DOTALL,
    )


def readable(text: str, tags: BoxTags | None, complete: bool = False) -> str:
    """An answer as a terminal shows it: label tags dropped (the label stays), each box or quad as
    " [x1,y1 - x2,y2]" (a point " [x,y]"), other special tokens (<|...|>) dropped. Until the
    answer is complete, what is still arriving (a box or quad not closed yet, a tag cut short at
    the end) is held back with what follows it: the result only grows as the text does."""
    if not complete:
        opened = text.rfind("<|")
        if opened > text.rfind("|>"):
            text = text[:opened]
    if tags is not None:
        for start, end in (tags.box, tags.quad) if not complete else ():
            opened = text.rfind(start)
            if opened > text.rfind(end):
                text = text[:opened]
        for tag in (*tags.ref, *tags.box, *tags.quad) if not complete else ():
            cut = next((n for n in range(len(tag) - 1, 0, -1) if text.endswith(tag[:n])), 0)
            text = text[: len(text) - cut]

        for tag in tags.ref:  # open or closed: the label reads as it comes
            text = text.replace(tag, "")

        def shown(m: re.Match[str]) -> str:
            values = [f"{v:g}" for v in _numbers(m.group("box") if m.group("box") is not None else m.group("quad"))]
            pairs = [",".join(values[i : i + 2]) for i in range(0, len(values), 2)]
            return " [" + " - ".join(pairs) + "]"

        text = _tag_pattern(tags).sub(shown, text)
    return re.sub(r"<\|[a-z_]+\|>", "", text)


def _numbers(text: str) -> list[float]:
    return [float(n) for n in _NUMBER.findall(text)]


def _find_tagged(text: str, tags: BoxTags) -> Iterator[RawBox]:
    label: str | None = None
    attach_from = 0  # a box directly after this offset belongs to `label`
    for m in _tag_pattern(tags).finditer(text):
        if m.group("ref") is not None:
            label, attach_from = m.group("ref").strip() or None, m.end()
            continue
        if label is not None and not _SEPARATOR.fullmatch(text, attach_from, m.start()):
            label = None
        attach_from = m.end()
        if m.group("quad") is not None:
            corners = _numbers(m.group("quad"))
            if len(corners) == 8:
                yield RawBox(label, tuple(corners), "quad", m.start())
            label = None  # a ref names one quad; a box after it is its own
            continue
        values = _numbers(m.group("box"))
        if len(values) == 2:
            yield RawBox(label, tuple(values), "point", m.start())
        elif values and len(values) % 4 == 0:  # several boxes in one tag: one per 4 numbers
            for i in range(0, len(values), 4):
                yield RawBox(label, tuple(values[i : i + 4]), "box", m.start())


def _find_json(text: str) -> Iterator[RawBox]:
    decoder = json.JSONDecoder()
    covered: list[tuple[int, int]] = []
    pos = text.find("{")
    while pos >= 0:
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:  # not JSON from here (or cut short): an inner object may still parse
            pos = text.find("{", pos + 1)
            continue
        covered.append((pos, end))
        for obj in _dicts(value):
            box = _from_object(obj, pos)
            if box is not None:
                yield box
        pos = text.find("{", end)
    for m in _LOOSE_COORDS.finditer(text):
        if any(a <= m.start() < b for a, b in covered):
            continue
        values = _numbers(m.group(2))
        kind: Literal["box", "point"] = "point" if m.group(1) in _POINT_KEYS else "box"
        if len(values) != (2 if kind == "point" else 4):
            continue
        # The label sits in the same object: between the braces around the key.
        lo = text.rfind("{", 0, m.start()) + 1
        hi = text.find("}", m.end())
        label = _LOOSE_LABEL.search(text, lo, len(text) if hi < 0 else hi)
        yield RawBox((label.group(1).strip() or None) if label else None, tuple(values), kind, m.start())


def _dicts(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from _dicts(v)
    elif isinstance(value, list):
        for v in value:
            yield from _dicts(v)


def _flat_numbers(value: Any) -> list[float] | None:
    """[1, 2, 3, 4], [[1, 2], [3, 4]] or ["1", "2", ...] as floats; None if anything else."""
    if not isinstance(value, list):
        return None
    out: list[float] = []
    for v in value:
        if isinstance(v, list):
            inner = _flat_numbers(v)
            if inner is None:
                return None
            out.extend(inner)
        elif (isinstance(v, (int, float)) and not isinstance(v, bool)) or (
            isinstance(v, str) and _NUMBER.fullmatch(v.strip())
        ):
            out.append(float(v))
        else:
            return None
    return out


def _from_object(obj: dict[str, Any], start: int) -> RawBox | None:
    kind: Literal["box", "point"]
    for keys, kind, count in ((_BOX_KEYS, "box", 4), (_POINT_KEYS, "point", 2)):
        key = next((k for k in keys if k in obj), None)
        if key is None:
            continue
        values = _flat_numbers(obj[key])
        if values is None or len(values) != count or not all(math.isfinite(v) for v in values):
            return None
        label = next((obj[k] for k in _LABEL_KEYS if isinstance(obj.get(k), str)), None)
        return RawBox((label.strip() or None) if label else None, tuple(values), kind, start)
    return None


# -- mapping to the original image ----------------------------------------------------------------


def to_original(
    raw: RawBox, convention: GroundingConvention, original_size: tuple[int, int], resized_size: tuple[int, int]
) -> Box:
    """Map one box to the original image's pixels (sizes are (width, height))."""
    width, height = original_size
    if convention.coordinates == "resized_pixels":
        sx, sy = width / resized_size[0], height / resized_size[1]
    else:
        sx, sy = width / NORMALIZED_SCALE, height / NORMALIZED_SCALE
    if raw.kind == "quad":
        return _quad_to_original(raw, convention.name, (width, height), sx, sy)
    if raw.kind == "point":
        x, y = raw.values
        x1 = x2 = x * sx
        y1 = y2 = y * sy
        swapped = False
    else:
        x1, y1, x2, y2 = raw.values[0] * sx, raw.values[1] * sy, raw.values[2] * sx, raw.values[3] * sy
        swapped = x1 > x2 or y1 > y2
        x1, x2 = min(x1, x2), max(x1, x2)
        y1, y2 = min(y1, y2), max(y1, y2)
    mapped = (x1, y1, x2, y2)
    cx1, cx2 = (min(max(v, 0.0), float(width)) for v in (x1, x2))
    cy1, cy2 = (min(max(v, 0.0), float(height)) for v in (y1, y2))
    clamped = (cx1, cy1, cx2, cy2) != mapped
    return Box(
        label=raw.label,
        x1=cx1,
        y1=cy1,
        x2=cx2,
        y2=cy2,
        convention=convention.name,
        raw=raw.values,
        kind=raw.kind,
        clamped=clamped,
        unclamped=mapped if clamped else None,
        swapped=swapped,
        degenerate=raw.kind == "box" and (cx1 == cx2 or cy1 == cy2),
    )


def _quad_to_original(raw: RawBox, convention: str, size: tuple[int, int], sx: float, sy: float) -> Box:
    width, height = size
    mapped = [(raw.values[i] * sx, raw.values[i + 1] * sy) for i in range(0, 8, 2)]
    corners = tuple((min(max(x, 0.0), float(width)), min(max(y, 0.0), float(height))) for x, y in mapped)
    xs, ys = [x for x, _ in corners], [y for _, y in corners]
    clamped = corners != tuple(mapped)
    unclamped = (
        min(x for x, _ in mapped),
        min(y for _, y in mapped),
        max(x for x, _ in mapped),
        max(y for _, y in mapped),
    )
    return Box(
        label=raw.label,
        x1=min(xs),
        y1=min(ys),
        x2=max(xs),
        y2=max(ys),
        convention=convention,
        raw=raw.values,
        kind="quad",
        clamped=clamped,
        unclamped=unclamped if clamped else None,
        degenerate=min(xs) == max(xs) or min(ys) == max(ys),
        corners=corners,
    )


def parse_boxes(
    text: str, convention: GroundingConvention, original_size: tuple[int, int], resized_size: tuple[int, int]
) -> list[Box]:
    """The boxes and points in generated text (JSON, and the convention's tagged syntax), in the
    original image's pixels. The convention of a server's answer: vlmserve.registry's
    grounding_convention(response's `vlmserve.grounding_convention`).

    original_size and resized_size are (width, height): RequestOutput.mm_items[i] (offline) or
    the response's `vlmserve.mm_items[i]` (server). With several images, which image a box is on is
    for the caller to say; the text does not."""
    tags = [] if convention.tags is None else [convention.tags]
    return [to_original(raw, convention, original_size, resized_size) for raw in find_boxes(text, tags)]


def format_boxes(boxes: Sequence[Box], original_size: tuple[int, int], resized_size: tuple[int, int]) -> list[str]:
    """Lines for a person: each box in original pixels and what was changed."""
    ow, oh = original_size
    rw, rh = resized_size
    convention = boxes[0].convention if boxes else None
    head = f"{len(boxes)} box{'es' if len(boxes) != 1 else ''} in original image pixels ({ow}x{oh}"
    head += f"; the model saw {rw}x{rh}" + (f", {convention} coordinates" if convention else "") + ")"
    lines = [head + (":" if boxes else "")]
    for i, box in enumerate(boxes, start=1):
        name = box.label if box.label is not None else "(no label)"
        if box.kind == "point":
            where = f"point ({box.x1:.1f}, {box.y1:.1f})"
        elif box.kind == "quad" and box.corners is not None:
            where = "quad " + ", ".join(f"({x:.1f}, {y:.1f})" for x, y in box.corners)
        else:
            where = f"({box.x1:.1f}, {box.y1:.1f})-({box.x2:.1f}, {box.y2:.1f})"
        notes = []
        if box.clamped and box.unclamped is not None:
            a, b, c, d = box.unclamped
            notes.append(f"clamped to the image (was ({a:.1f}, {b:.1f})-({c:.1f}, {d:.1f}))")
        if box.swapped:
            notes.append("corners swapped")
        if box.degenerate:
            notes.append("degenerate: zero width or height")
        raw = ", ".join(f"{v:g}" for v in box.raw)
        lines.append(f"  {i}. {name}: {where} [model wrote {raw}]" + ("; " + "; ".join(notes) if notes else ""))
    return lines


# -- drawing --------------------------------------------------------------------------------------

# Distinct, saturated colours (Tableau 10); one per label, in order of first appearance.
PALETTE: tuple[tuple[int, int, int], ...] = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)


def box_colors(boxes: Sequence[Box]) -> list[tuple[int, int, int]]:
    """One colour per label (a box without one gets its own)."""
    by_label: dict[str, tuple[int, int, int]] = {}
    colors = []
    next_color = 0
    for box in boxes:
        if box.label is not None and box.label in by_label:
            colors.append(by_label[box.label])
            continue
        color = PALETTE[next_color % len(PALETTE)]
        next_color += 1
        if box.label is not None:
            by_label[box.label] = color
        colors.append(color)
    return colors


def draw_boxes(image: Image.Image, boxes: Sequence[Box], line_width: int | None = None) -> Image.Image:
    """A copy of `image` (the ORIGINAL image, EXIF rotation applied, as the processor decoded it)
    with each box outlined and labelled. Points are drawn as small crosses."""
    out = image.convert("RGB")  # always a copy
    draw = ImageDraw.Draw(out)
    width, height = out.size
    line = line_width or max(1, round(max(width, height) / 400))
    font = ImageFont.load_default()
    for box, color in zip(boxes, box_colors(boxes), strict=True):
        # Continuous [x1, x2) to the pixels it covers: columns x1 .. x2 - 1, inside the image.
        left = min(max(math.floor(box.x1), 0), width - 1)
        top = min(max(math.floor(box.y1), 0), height - 1)
        right = min(max(math.ceil(box.x2) - 1, left), width - 1)
        bottom = min(max(math.ceil(box.y2) - 1, top), height - 1)
        if box.kind == "quad" and box.corners is not None:
            draw.polygon([(round(x), round(y)) for x, y in box.corners], outline=color, width=line)
        elif box.kind == "point":
            arm = 3 * line + 2
            draw.line([(left - arm, top), (left + arm, top)], fill=color, width=line)
            draw.line([(left, top - arm), (left, top + arm)], fill=color, width=line)
        else:
            draw.rectangle([left, top, right, bottom], outline=color, width=line)
        if box.label:
            _draw_label(draw, font, box.label, color, left, top, line)
    return out


def _draw_label(
    draw: ImageDraw.ImageDraw,
    font: ImageFont.ImageFont | ImageFont.FreeTypeFont,
    label: str,
    color: tuple[int, int, int],
    left: int,
    top: int,
    line: int,
) -> None:
    x0, y0, x1, y1 = draw.textbbox((0, 0), label, font=font)
    text_w, text_h = x1 - x0 + 4, y1 - y0 + 4
    # Above the box when there is room, else just inside its top edge.
    y = top - text_h if top >= text_h else top + line
    draw.rectangle([left, y, left + text_w - 1, y + text_h - 1], fill=color)
    ink = (0, 0, 0) if sum(c * w for c, w in zip(color, (299, 587, 114), strict=True)) > 150_000 else (255, 255, 255)
    draw.text((left + 2 - x0, y + 2 - y0), label, fill=ink, font=font)


def save_boxes_png(image: Image.Image, boxes: Sequence[Box], path: str | Path) -> Path:
    """Draw the boxes on `image` and write a PNG."""
    path = Path(path)
    draw_boxes(image, boxes).save(path, format="PNG")
    return path


def draw_answer(
    text: str,
    image: Image.Image,
    convention: GroundingConvention,
    resized_size: tuple[int, int],
    path: str | Path,
) -> tuple[list[Box], list[str]]:
    """What `vlmserve chat --draw-boxes` does with an answer: the boxes in `text` mapped onto
    `image` (the original, as the processor decoded it), drawn into a PNG at `path`; returns
    them with the lines to print."""
    boxes = parse_boxes(text, convention, image.size, resized_size)
    written = save_boxes_png(image, boxes, path)
    drawn = f"{len(boxes)} box{'es' if len(boxes) != 1 else ''}"
    return boxes, [*format_boxes(boxes, image.size, resized_size), f"wrote the image with {drawn} drawn to {written}"]
