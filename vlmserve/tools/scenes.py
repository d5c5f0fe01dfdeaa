"""Synthetic scenes for the demo checkpoint: a few coloured shapes on a plain or noisy background,
each with its ground truth, and the fixed question/answer formats the demo model is trained on.

A scene holds 1 to 3 shapes (circle, square, triangle; red, green, blue, yellow; small or
large), no two of the same colour and kind, not overlapping, so "the red circle" always names
one shape; half the scenes also hold one dark text glyph (a letter or digit) beside them.
Everything is drawn from a seeded `random.Random`, so a seed gives the same scene, picture and
questions on every machine (glyphs in Pillow's own font, so one Pillow version draws the same).

The question formats (the only ones the demo model knows; see docs/demo-model.md):

  describe  "What is in this picture?" | "Describe the picture."
            -> "A large red circle above a small blue square."  (2 shapes: "above" / "to the left
               of" by the larger offset; 1 or 3 shapes: listed from left to right)
  count     "How many shapes are there?" -> "There are two shapes."
  colour    "What colour is the circle?" (asked when one circle) -> "The circle is red."
  shape     "What shape is the red one?" (asked when one red shape) -> "The red shape is a circle."
  position  "Where is the red circle?" -> "The red circle is at the top left."  (thirds of the picture)
  ground    "Find the red circle." -> Qwen2-VL's own box format on a 0..1000 scale of the picture,
            `<|object_ref_start|>the red circle<|object_ref_end|><|box_start|>(x1,y1),(x2,y2)<|box_end|>`
  ground_all "Find every shape." -> one such box per shape, left to right, joined by ", "
  text      "What does the text say?" -> 'The text says "K".' | "There is no text."
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 70),
    "blue": (40, 80, 225),
    "yellow": (240, 200, 30),
}
KINDS = ("circle", "square", "triangle")
SIZES = {"small": 0.18, "large": 0.30}  # side of the shape's box, as a share of the picture's side
NUMBERS = ("zero", "one", "two", "three")
QUESTION_KINDS = ("describe", "count", "colour", "shape", "position", "ground", "ground_all", "text")
GLYPHS = ("A", "E", "H", "K", "R", "X", "2", "5", "7")  # one token each in Qwen's vocabulary
GLYPH_SIZE = (0.16, 0.22)  # the glyph's box side, as a share of the picture's side
GLYPH_INK = (25, 25, 25)
TEXT_QUESTION = "What does the text say?"
DESCRIBE_QUESTIONS = ("What is in this picture?", "Describe the picture.")

REF_START, REF_END = "<|object_ref_start|>", "<|object_ref_end|>"
BOX_START, BOX_END = "<|box_start|>", "<|box_end|>"


@dataclass(frozen=True)
class Shape:
    kind: str  # one of KINDS
    colour: str  # one of COLOURS
    size: str  # one of SIZES
    box: tuple[float, float, float, float]  # (x1, y1, x2, y2) as shares of the picture's width and height

    @property
    def name(self) -> str:
        return f"{self.colour} {self.kind}"

    @property
    def centre(self) -> tuple[float, float]:
        x1, y1, x2, y2 = self.box
        return (x1 + x2) / 2, (y1 + y2) / 2


@dataclass(frozen=True)
class Glyph:
    char: str  # one of GLYPHS
    box: tuple[float, float, float, float]  # the square it is drawn in, as shares of the picture


@dataclass(frozen=True)
class Scene:
    shapes: tuple[Shape, ...]
    background: tuple[int, int, int]
    noise: float  # standard deviation of the background's pixel noise (0: plain)
    seed: int  # draws the noise
    glyph: Glyph | None = None  # text beside the shapes (not a shape: never counted or described)


@dataclass(frozen=True)
class QA:
    kind: str  # one of QUESTION_KINDS
    question: str
    answer: str


def random_scene(rng: random.Random) -> Scene:
    count = rng.choice((1, 2, 2, 3, 3))
    shapes: list[Shape] = []
    used: set[tuple[str, str]] = set()
    while len(shapes) < count:
        kind, colour = rng.choice(KINDS), rng.choice(tuple(COLOURS))
        if (kind, colour) in used:
            continue
        size = rng.choice(tuple(SIZES))
        box = _free_box(rng, SIZES[size] * rng.uniform(0.9, 1.1), shapes)
        if box is None:  # no room left: a smaller scene
            break
        shapes.append(Shape(kind, colour, size, box))
        used.add((kind, colour))
    shade = rng.randint(215, 255)
    tint = tuple(min(255, shade + rng.randint(-12, 12)) for _ in range(3))
    noise = rng.choice((0.0, 0.0, 6.0, 12.0))
    seed = rng.randrange(1 << 30)
    glyph = _place_glyph(rng, shapes) if rng.random() < 0.5 else None
    return Scene(tuple(shapes), tint, noise, seed, glyph)  # type: ignore[arg-type]


def _place_glyph(rng: random.Random, shapes: list[Shape]) -> Glyph | None:
    side = rng.uniform(*GLYPH_SIZE)
    char = rng.choice(GLYPHS)
    box = _free_box(rng, side, shapes)
    return None if box is None else Glyph(char, box)  # None: no room beside the shapes


def _free_box(rng: random.Random, side: float, shapes: list[Shape]) -> tuple[float, float, float, float] | None:
    """A side x side square clear of every shape by a margin, from up to 100 random tries."""
    for _ in range(100):
        x1, y1 = rng.uniform(0.03, 0.97 - side), rng.uniform(0.03, 0.97 - side)
        box = (x1, y1, x1 + side, y1 + side)
        if all(_apart(box, s.box, 0.04) for s in shapes):
            return box
    return None


def _apart(a: tuple[float, ...], b: tuple[float, ...], gap: float) -> bool:
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def draw(scene: Scene, size: int = 448) -> Image.Image:
    """The scene as a size x size RGB picture."""
    image = Image.new("RGB", (size, size), scene.background)
    if scene.noise:
        import numpy as np

        gen = np.random.default_rng(scene.seed)
        pixels = np.asarray(image, dtype=np.float32) + gen.normal(0.0, scene.noise, (size, size, 1))
        image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    canvas = ImageDraw.Draw(image)
    for shape in scene.shapes:
        x1, y1, x2, y2 = (v * size for v in shape.box)
        fill = COLOURS[shape.colour]
        if shape.kind == "circle":
            canvas.ellipse((x1, y1, x2, y2), fill=fill)
        elif shape.kind == "square":
            canvas.rectangle((x1, y1, x2, y2), fill=fill)
        else:
            canvas.polygon([((x1 + x2) / 2, y1), (x2, y2), (x1, y2)], fill=fill)
    if scene.glyph is not None:
        x1, y1, x2, y2 = (v * size for v in scene.glyph.box)
        # Pillow's own scalable font (no font file needed), the glyph's cap height about its box's.
        font_size = max(8, round((y2 - y1) * 1.3))
        font = ImageFont.load_default(size=font_size)
        canvas.text(
            ((x1 + x2) / 2, (y1 + y2) / 2),
            scene.glyph.char,
            fill=GLYPH_INK,
            font=font,
            anchor="mm",
            stroke_width=round(font_size / 24),
            stroke_fill=GLYPH_INK,
        )
    return image


def _article(words: str) -> str:
    return ("an " if words[0] in "aeiou" else "a ") + words


def _phrase(shape: Shape) -> str:
    return _article(f"{shape.size} {shape.colour} {shape.kind}")


def describe(scene: Scene) -> str:
    shapes = sorted(scene.shapes, key=lambda s: s.centre[0])
    if len(shapes) == 2:
        (ax, ay), (bx, by) = shapes[0].centre, shapes[1].centre
        if abs(bx - ax) >= abs(by - ay):
            text = f"{_phrase(shapes[0])} to the left of {_phrase(shapes[1])}"
        else:
            top, bottom = (shapes[0], shapes[1]) if ay < by else (shapes[1], shapes[0])
            text = f"{_phrase(top)} above {_phrase(bottom)}"
    elif len(shapes) == 3:
        text = f"{_phrase(shapes[0])}, {_phrase(shapes[1])} and {_phrase(shapes[2])}"
    else:
        text = _phrase(shapes[0])
    return text[0].upper() + text[1:] + "."


def _left_to_right(shape: Shape) -> float:
    return shape.centre[0]


def region(shape: Shape) -> str:
    x, y = shape.centre
    col = 0 if x < 1 / 3 else 1 if x < 2 / 3 else 2
    row = 0 if y < 1 / 3 else 1 if y < 2 / 3 else 2
    return (
        ("at the top left", "at the top", "at the top right"),
        ("on the left", "in the centre", "on the right"),
        ("at the bottom left", "at the bottom", "at the bottom right"),
    )[row][col]


def box_text(box: tuple[float, float, float, float]) -> str:
    """(x1,y1),(x2,y2) on Qwen2-VL's 0..1000 scale, rounded to tens (the demo model writes tens)."""
    x1, y1, x2, y2 = (min(1000, max(0, 10 * round(v * 100))) for v in box)
    return f"({x1},{y1}),({x2},{y2})"


def grounding(shape: Shape) -> str:
    return f"{REF_START}the {shape.name}{REF_END}{BOX_START}{box_text(shape.box)}{BOX_END}"


def questions(scene: Scene, rng: random.Random) -> list[QA]:
    """Every question kind that has one answer for this scene, one question of each."""
    shapes = scene.shapes
    n = len(shapes)
    verb = "is" if n == 1 else "are"
    out = [
        QA("describe", rng.choice(DESCRIBE_QUESTIONS), describe(scene)),
        QA("count", "How many shapes are there?", f"There {verb} {NUMBERS[n]} shape{'s' * (n > 1)}."),
        QA("ground_all", "Find every shape.", ", ".join(grounding(s) for s in sorted(shapes, key=_left_to_right))),
    ]
    by_kind = [s for s in shapes if sum(t.kind == s.kind for t in shapes) == 1]
    by_colour = [s for s in shapes if sum(t.colour == s.colour for t in shapes) == 1]
    if by_kind:
        s = rng.choice(by_kind)
        out.append(QA("colour", f"What colour is the {s.kind}?", f"The {s.kind} is {s.colour}."))
    if by_colour:
        s = rng.choice(by_colour)
        out.append(QA("shape", f"What shape is the {s.colour} one?", f"The {s.colour} shape is {_article(s.kind)}."))
    s = rng.choice(shapes)
    out.append(QA("position", f"Where is the {s.name}?", f"The {s.name} is {region(s)}."))
    s = rng.choice(shapes)
    out.append(QA("ground", f"Find the {s.name}.", grounding(s)))
    glyph = scene.glyph
    out.append(QA("text", TEXT_QUESTION, f'The text says "{glyph.char}".' if glyph else "There is no text."))
    return out


def iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


# examples/shapes.png: a scene the training never drew (training draws seeds 0.. steps).
EXAMPLE_SEED = 2_000_000_004
EXAMPLE_SIZE = 448


def example_scene() -> Scene:
    return random_scene(random.Random(EXAMPLE_SEED))


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m vlmserve.tools.scenes", description="Draw a scene and print its questions and answers."
    )
    parser.add_argument("out", help="PNG to write (examples/shapes.png is the default scene seed's)")
    parser.add_argument("--seed", type=int, default=EXAMPLE_SEED)
    parser.add_argument("--size", type=int, default=EXAMPLE_SIZE)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    scene = random_scene(rng)
    draw(scene, args.size).save(args.out)
    for qa in questions(scene, rng):
        print(f"{qa.kind}: {qa.question} -> {qa.answer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
