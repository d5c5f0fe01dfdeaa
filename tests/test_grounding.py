"""Grounding boxes: parsed in each Qwen generation's syntax, mapped to the original image's pixels
through the resize the processor applied, clamped, drawn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import random_image
from vlmserve import LLM, SamplingParams
from vlmserve.api.output_processor import OutputProcessor
from vlmserve.grounding import (
    PALETTE,
    Box,
    GroundingConvention,
    draw_answer,
    draw_boxes,
    find_boxes,
    format_boxes,
    parse_boxes,
)
from vlmserve.ipc.contracts import EngineCoreOutput
from vlmserve.multimodal.image import smart_resize
from vlmserve.outputs import MultiModalItemInfo
from vlmserve.registry import GROUNDING_CONVENTIONS, convention_for_model, grounding_convention
from vlmserve.tokenizer import Tokenizer

EOS = 151645  # <|im_end|>


def resized(width: int, height: int) -> tuple[int, int]:
    """(width, height) after the processor's smart_resize (default pixel limits)."""
    h, w = smart_resize(height, width)
    return w, h


def xyxy(box: Box) -> tuple[float, float, float, float]:
    return box.xyxy


def named(name: str) -> GroundingConvention:
    """A family's convention by its name, as a client finds the one a response names."""
    return grounding_convention(name)


# Both tagged syntaxes: Qwen-VL-Chat's <ref>/<box>, and the Qwen2 vocabulary's box tokens.
EVERY_TAG_SYNTAX = [named("qwen-vl").tags, named("qwen2-vl").tags]


# -- the conventions ----------------------------------------------------------------------------


def test_seed_000_worked_example() -> None:
    # Qwen-VL-Chat on the 2048 x 1365 demo photo; the reference's cv2 code truncates x / 1000 * w.
    text = "<ref>击掌</ref><box>(536,509),(588,602)</box>"
    (box,) = parse_boxes(text, named("qwen-vl"), (2048, 1365), resized(2048, 1365))
    assert box.label == "击掌" and box.raw == (536, 509, 588, 602) and box.convention == "qwen-vl"
    assert tuple(int(v) for v in xyxy(box)) == (1097, 694, 1204, 821)
    assert xyxy(box) == pytest.approx((1097.728, 694.785, 1204.224, 821.73))
    assert not (box.clamped or box.swapped or box.degenerate)
    # The answer the reference's dialogue shows, and its list-format example with spaces.
    (box,) = parse_boxes("<ref>击掌</ref><box>(517,508),(589,611)</box>", named("qwen-vl"), (2048, 1365), (1204, 812))
    assert xyxy(box) == pytest.approx((517 * 2.048, 508 * 1.365, 589 * 2.048, 611 * 1.365))
    (box,) = parse_boxes("<ref>香蕉</ref><box>(10, 100),(30,200)</box>", named("qwen-vl"), (1000, 500), (1008, 504))
    assert box.label == "香蕉" and xyxy(box) == pytest.approx((10, 50, 30, 100))


@pytest.mark.parametrize("size", [(640, 480), (333, 777), (1000, 250), (2048, 1365)])
def test_qwen2_vl_is_normalised_to_the_original_size(size: tuple[int, int]) -> None:
    w, h = size
    text = "<|object_ref_start|>a cat<|object_ref_end|><|box_start|>(100,250),(600,1000)<|box_end|>"
    (box,) = parse_boxes(text, named("qwen2-vl"), size, resized(w, h))
    assert box.label == "a cat"
    assert xyxy(box) == pytest.approx((0.1 * w, 0.25 * h, 0.6 * w, 1.0 * h))
    assert not box.clamped  # 1000 is the image's edge, not past it
    # The 0..1000 scale does not depend on the resize.
    assert parse_boxes(text, named("qwen2-vl"), size, (28, 28)) == [box]


@pytest.mark.parametrize("size", [(640, 480), (333, 777), (1000, 250), (2048, 1365)])
def test_qwen2_5_vl_is_in_resized_pixels(size: tuple[int, int]) -> None:
    w, h = size
    rw, rh = resized(w, h)
    assert (rw, rh) != (w, h)  # every case here is really resized
    # A box over the resized image's right half, bottom quarter.
    text = f'```json\n[\n\t{{"bbox_2d": [{rw // 2}, {rh * 3 // 4}, {rw}, {rh}], "label": "dog"}}\n]\n```'
    (box,) = parse_boxes(text, named("qwen2.5-vl"), (w, h), (rw, rh))
    assert box.label == "dog" and box.raw == (rw // 2, rh * 3 // 4, rw, rh)
    assert xyxy(box) == pytest.approx((rw // 2 * w / rw, rh * 3 // 4 * h / rh, w, h))
    assert not box.clamped
    # The same numbers read as 0..1000 would be somewhere else entirely.
    assert xyxy(parse_boxes(text, named("qwen2-vl"), (w, h), (rw, rh))[0]) != pytest.approx(xyxy(box))


def test_points() -> None:
    text = '[{"point_2d": [322, 406], "label": "eye"}]'
    (point,) = parse_boxes(text, named("qwen2.5-vl"), (1000, 250), (1008, 252))
    assert point.kind == "point" and point.label == "eye" and not point.degenerate
    assert xyxy(point) == pytest.approx((322 * 1000 / 1008, 250.0, 322 * 1000 / 1008, 250.0))
    assert point.clamped and point.unclamped == pytest.approx((319.44, 402.78, 319.44, 402.78), abs=0.01)
    (point,) = parse_boxes("<|box_start|>(500,500)<|box_end|>", named("qwen2-vl"), (640, 480), (644, 476))
    assert point.kind == "point" and xyxy(point) == (320, 240, 320, 240)


def test_convention_from_the_model() -> None:
    assert convention_for_model("qwen2_vl").name == "qwen2-vl"
    assert convention_for_model("qwen2_5_vl").name == "qwen2.5-vl"
    assert convention_for_model("qwen3_vl") == convention_for_model("qwen3_vl_moe") == named("qwen3-vl")
    assert convention_for_model("qwen").name == "qwen-vl"
    assert list(GROUNDING_CONVENTIONS) == ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen-vl"]
    assert [c.coordinates for c in GROUNDING_CONVENTIONS.values()] == [
        "normalized",
        "resized_pixels",
        "normalized",
        "normalized",
    ]
    with pytest.raises(ValueError, match="no known box convention for model_type 'llava'"):
        convention_for_model("llava")
    raw = find_boxes("<box>(1,2),(3,4)</box>", [named("qwen-vl").tags])
    with pytest.raises(ValueError, match="unknown box convention 'qwen3'"):
        parse_boxes("<box>(1,2),(3,4)</box>", named("qwen3"), (10, 10), (28, 28))
    assert len(raw) == 1


def test_each_convention_reads_its_own_tags_and_json() -> None:
    """A family's convention reads the tagged syntax its model writes (Qwen-VL-Chat's <ref>/<box>,
    the Qwen2 vocabulary's box tokens), and JSON; another family's tags are text to it."""
    qwen_vl = "<ref>a</ref><box>(100,200),(300,400)</box>"
    tokens = "<|object_ref_start|>a<|object_ref_end|><|box_start|>(100,200),(300,400)<|box_end|>"
    json_box = '{"bbox_2d": [100, 200, 300, 400], "label": "a"}'
    size = (1000, 1000)
    for name, own, other in [
        ("qwen-vl", qwen_vl, tokens),
        ("qwen2-vl", tokens, qwen_vl),
        ("qwen3-vl", tokens, qwen_vl),
    ]:
        convention = named(name)
        assert [(b.label, b.xyxy) for b in parse_boxes(own, convention, size, size)] == [("a", (100, 200, 300, 400))]
        assert [(b.label, b.xyxy) for b in parse_boxes(json_box, convention, size, size)] == [
            ("a", (100, 200, 300, 400))
        ]
        assert parse_boxes(other, convention, size, size) == []


# -- what is fixed and said ---------------------------------------------------------------------


def test_outside_the_image_is_clamped_and_flagged() -> None:
    text = "<|object_ref_start|>sky<|object_ref_end|><|box_start|>(-20,900),(1100,1050)<|box_end|>"
    (box,) = parse_boxes(text, named("qwen2-vl"), (640, 480), (644, 476))
    assert box.clamped and xyxy(box) == pytest.approx((0, 432, 640, 480))
    assert box.unclamped == pytest.approx((-12.8, 432, 704, 504))
    # Qwen2.5-VL: past the resized width is past the original width.
    (box,) = parse_boxes('{"bbox_2d": [100, 10, 700, 300]}', named("qwen2.5-vl"), (640, 480), (644, 476))
    assert box.clamped and box.x2 == 640
    assert box.unclamped == pytest.approx((100 * 640 / 644, 10 * 480 / 476, 700 * 640 / 644, 300 * 480 / 476))
    # Wholly outside: kept, clamped to the edge, degenerate.
    (box,) = parse_boxes("<box>(1100,100),(1200,200)</box>", named("qwen-vl"), (640, 480), (644, 476))
    assert box.clamped and box.degenerate and (box.x1, box.x2) == (640, 640)


def test_swapped_corners_are_put_in_order() -> None:
    (box,) = parse_boxes("<box>(600,700),(100,200)</box>", named("qwen-vl"), (1000, 500), (1008, 504))
    assert box.swapped and not box.clamped and xyxy(box) == pytest.approx((100, 100, 600, 350))
    (box,) = parse_boxes('{"bbox_2d": [10, 300, 500, 20]}', named("qwen2.5-vl"), (1000, 500), (1000, 500))
    assert box.swapped and xyxy(box) == (10, 20, 500, 300)


def test_degenerate_boxes_are_kept_and_flagged() -> None:
    (box,) = parse_boxes("<box>(100,200),(100,400)</box>", named("qwen-vl"), (1000, 500), (1008, 504))
    assert box.degenerate and not box.clamped and xyxy(box) == (100, 100, 100, 200)


# -- the tagged syntax --------------------------------------------------------------------------


def test_several_boxes_per_ref_and_boxes_without_one() -> None:
    text = (
        "There are <|object_ref_start|>two dogs<|object_ref_end|>"
        "<|box_start|>(10,20),(30,40)<|box_end|><|box_start|>(50,60),(70,80)<|box_end|>, "
        "<|box_start|>(1,2),(3,4)<|box_end|> and a <|object_ref_start|>cat<|object_ref_end|> \n"
        "<|box_start|> ( 100 , 200 ) , ( 300 , 400 ) <|box_end|>. Also, somewhere:"
        "<|box_start|>(5,6),(7,8)<|box_end|>"
    )
    boxes = parse_boxes(text, named("qwen2-vl"), (1000, 1000), (1008, 1008))
    assert [(b.label, b.raw) for b in boxes] == [
        ("two dogs", (10, 20, 30, 40)),
        ("two dogs", (50, 60, 70, 80)),
        ("two dogs", (1, 2, 3, 4)),  # only separators since the previous box of the ref
        ("cat", (100, 200, 300, 400)),  # whitespace and a newline tolerated
        (None, (5, 6, 7, 8)),  # text in between: the box has no ref
    ]
    assert all(b.convention == "qwen2-vl" for b in boxes)


def test_qwen_vl_tags_go_the_same_way() -> None:
    text = "<ref>a</ref><box>(10,20),(30,40)</box><box>(50,60),(70,80)</box> then <box>(1,2),(3,4)</box>"
    tagged = text.replace("<ref>", "<|object_ref_start|>").replace("</ref>", "<|object_ref_end|>")
    tagged = tagged.replace("<box>", "<|box_start|>").replace("</box>", "<|box_end|>")
    boxes = parse_boxes(text, named("qwen-vl"), (800, 600), (812, 588))
    assert [(b.label, b.raw) for b in boxes] == [("a", (10, 20, 30, 40)), ("a", (50, 60, 70, 80)), (None, (1, 2, 3, 4))]
    assert [b.xyxy for b in boxes] == [b.xyxy for b in parse_boxes(tagged, named("qwen2-vl"), (800, 600), (812, 588))]


def test_unfinished_or_odd_tags_are_skipped() -> None:
    text = (
        "<ref>x</ref><box>(1,2),(3</box>"  # 3 numbers
        "<box>(1,2),(3,4),(5,6)</box>"  # 6 numbers
        "<ref>sign</ref><quad>(568,121),(625,131),(624,182),(567,172)</quad>"  # a quad: 4 corners
        "<quad>(1,2),(3,4)</quad>"  # a quad needs 8 numbers
        "<box>(10,20),(30,40)</box>"  # fine, but after a quad: no label
        "<box>(9,9),(99,99)"  # no end tag (cut by max_tokens)
    )
    assert [(b.label, b.kind, b.values) for b in find_boxes(text, EVERY_TAG_SYNTAX)] == [
        ("sign", "quad", (568, 121, 625, 131, 624, 182, 567, 172)),
        (None, "box", (10, 20, 30, 40)),
    ]


# -- the JSON syntax ----------------------------------------------------------------------------


def test_lenient_json() -> None:
    text = """Here you go:
```json
[
  {"bbox_2d": [10, 20, 30, 40], "label": "a"},
  {"bbox_2d": [11, 21, 31, 41], "label": "b",},
  {'bbox_2d': [12, 22, 32, 42], 'label': 'c'},
  {"bbox_2d": [13, 23, 33], "label": "three numbers"},
  {"bbox_2d": "13, 23, 33, 43", "label": "a string"},
  {"bbox_2d": [NaN, 1, 2, 3], "label": "nan"},
  {"label": "no box"},
  {"bbox_2d": ["14", "24", "34", "44"], "text_content": "OCR line"},
  {"bbox_2d": [[15, 25], [35, 45]], "label": "pairs"},
  {"objects": [{"bbox": [16, 26, 36, 46], "label": "nested"}]},
  {"point_2d": [17, 27], "label": "p"},
  {"bbox_2d": [18, 28, 38, 48], "label": "trunc
```"""
    found = [(b.label, b.values, b.kind) for b in find_boxes(text, EVERY_TAG_SYNTAX)]
    assert found == [
        ("a", (10, 20, 30, 40), "box"),
        ("b", (11, 21, 31, 41), "box"),  # trailing comma: found by the fallback, label kept
        ("c", (12, 22, 32, 42), "box"),  # single quotes: likewise
        ("OCR line", (14, 24, 34, 44), "box"),
        ("pairs", (15, 25, 35, 45), "box"),
        ("nested", (16, 26, 36, 46), "box"),
        ("p", (17, 27), "point"),
        (None, (18, 28, 38, 48), "box"),  # the label was cut off
    ]


def test_every_truncation_parses_to_a_prefix_of_the_full_answer() -> None:
    answer = (
        '```json\n[\n  {"bbox_2d": [135, 114, 1016, 672], "label": "bird"},\n'
        '  {"point_2d": [40, 50], "label": "beak"},\n  {"bbox_2d": [1, 2, 300, 400], "label": "branch"}\n]\n```'
        " and <|object_ref_start|>leaf<|object_ref_end|><|box_start|>(5,6),(700,800)<|box_end|>"
    )
    full = [b.values for b in find_boxes(answer, EVERY_TAG_SYNTAX)]
    assert len(full) == 4
    for cut in range(len(answer) + 1):
        values = [b.values for b in find_boxes(answer[:cut], EVERY_TAG_SYNTAX)]
        assert values == full[: len(values)], answer[:cut]
        parse_boxes(answer[:cut], named("qwen2.5-vl"), (640, 480), (644, 476))  # never raises


# -- the sizes reach the user -------------------------------------------------------------------


def test_skip_special_tokens_false_keeps_the_box_tokens_but_not_eos(tiny_dir: Path) -> None:
    tokenizer = Tokenizer(tiny_dir)
    answer = "<|object_ref_start|>the cat<|object_ref_end|><|box_start|>(100,200),(500,600)<|box_end|>"
    ids = [*tokenizer.encode(answer), EOS]
    info = MultiModalItemInfo("image", 3, 12, (640, 480), (644, 476))

    def run(params: SamplingParams) -> tuple[str, list[MultiModalItemInfo]]:
        processor = OutputProcessor(tokenizer)
        processor.add_request("r", None, [1, 2, 3], params, [info])
        outputs = []
        for i, token in enumerate(ids):
            done = i == len(ids) - 1
            update = EngineCoreOutput(
                request_id="r",
                new_token_ids=[token],
                finish_reason="stop" if done else None,
                stop_reason=None,
                num_cached_tokens=0,
            )
            outputs += processor.process([update])[0]
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == ids
        return outputs[-1].outputs[0].text, outputs[-1].mm_items

    text, mm_items = run(SamplingParams(skip_special_tokens=False))
    assert text == answer  # no "<|im_end|>" at the end, as in vLLM
    assert mm_items == [info]
    (box,) = parse_boxes(text, named("qwen2-vl"), info.original_size, info.resized_size)
    assert box.label == "the cat" and xyxy(box) == (64, 96, 320, 288)
    # The default drops special tokens: the numbers are there but no box can be told apart.
    text, _ = run(SamplingParams())
    assert text == "the cat(100,200),(500,600)" and parse_boxes(text, named("qwen2-vl"), (640, 480), (644, 476)) == []
    # include_stop_str_in_output keeps the stop token's text.
    assert run(SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True))[0] == answer + "<|im_end|>"


def test_request_output_lists_each_image_and_its_sizes(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir, dtype="float32", max_model_len=2048, kv_cache_memory_gib=0.01)
    wide, tall = random_image(150, 100, seed=1), random_image(70, 190, seed=2)
    content = [{"type": "image", "image": wide}, {"type": "image", "image": tall}, {"type": "text", "text": "Where?"}]
    (out,) = llm.chat([{"role": "user", "content": content}], SamplingParams(max_tokens=1))
    a, b = out.mm_items
    assert (a.modality, a.original_size, a.resized_size) == ("image", (150, 100), resized(150, 100))
    assert (b.modality, b.original_size, b.resized_size) == ("image", (70, 190), resized(70, 190))
    assert [a.length, b.length] == out.num_image_tokens
    for item in (a, b):
        assert set(out.prompt_token_ids[item.offset : item.offset + item.length]) == {151655}  # <|image_pad|>


# -- drawing ------------------------------------------------------------------------------------

GREY = (128, 128, 128)


def grey(width: int, height: int) -> Image.Image:
    return Image.new("RGB", (width, height), GREY)


def test_drawn_edges_are_coloured_and_the_rest_untouched(tmp_path: Path) -> None:
    text = (
        "<|object_ref_start|>cat<|object_ref_end|><|box_start|>(100,100),(500,600)<|box_end|>"
        "<|object_ref_start|>dog<|object_ref_end|><|box_start|>(600,500),(1100,900)<|box_end|>"
    )
    image = grey(300, 200)
    boxes, lines = draw_answer(text, image, named("qwen2-vl"), (308, 196), tmp_path / "out.png")
    assert [b.label for b in boxes] == ["cat", "dog"] and boxes[1].clamped
    assert lines[-1] == f"wrote the image with 2 boxes drawn to {tmp_path / 'out.png'}"
    drawn = np.asarray(Image.open(tmp_path / "out.png").convert("RGB"))
    assert np.array_equal(drawn, np.asarray(draw_boxes(image, boxes)))
    assert image.getpixel((30, 60)) == GREY  # the input is left alone
    cat, dog = PALETTE[0], PALETTE[1]
    # cat: x 30..150, y 20..120 -> edges on columns 30 and 149, rows 20 and 119.
    for x, y in [(30, 60), (149, 60), (90, 20), (90, 119), (30, 20), (149, 119)]:
        assert tuple(drawn[y, x]) == cat, (x, y)
    assert (drawn[21:119, 31:149] == GREY).all()  # inside
    for x, y in [(29, 60), (150, 60), (90, 120), (200, 10), (10, 190)]:
        assert tuple(drawn[y, x]) == GREY, (x, y)
    # Its label sits on a patch of its colour just above the top edge.
    assert (drawn[5:20, 30:40] != GREY).any() and tuple(drawn[19, 31]) == cat
    # dog: x 180..330 clamped to 300, y 100..180: its right edge is the image's last column.
    for x, y in [(180, 150), (299, 150), (240, 100), (240, 179)]:
        assert tuple(drawn[y, x]) == dog, (x, y)
    assert (drawn[101:179, 181:299] == GREY).all()
    assert tuple(drawn[190, 240]) == GREY and tuple(drawn[150, 179]) == GREY


def test_colours_follow_labels_and_points_are_crosses() -> None:
    text = (
        '[{"bbox_2d": [10, 10, 40, 40], "label": "a"}, {"bbox_2d": [50, 10, 90, 40], "label": "b"},'
        ' {"bbox_2d": [10, 50, 40, 90], "label": "a"}, {"point_2d": [70, 70]}]'
    )
    boxes = parse_boxes(text, named("qwen2.5-vl"), (100, 100), (100, 100))
    drawn = np.asarray(draw_boxes(grey(100, 100), boxes))
    assert tuple(drawn[25, 10]) == tuple(drawn[70, 10]) == PALETTE[0]  # both "a"
    assert tuple(drawn[25, 50]) == PALETTE[1]
    assert tuple(drawn[70, 70]) == tuple(drawn[70, 73]) == tuple(drawn[67, 70]) == PALETTE[2]
    assert tuple(drawn[67, 67]) == GREY  # a cross, not a square


def test_format_boxes_is_what_the_cli_prints() -> None:
    text = (
        "<|object_ref_start|>cat<|object_ref_end|><|box_start|>(100,200),(500,600)<|box_end|>"
        "<|box_start|>(900,900),(1100,800)<|box_end|>"
    )
    boxes = parse_boxes(text, named("qwen2-vl"), (640, 480), (644, 476))
    assert format_boxes(boxes, (640, 480), (644, 476)) == [
        "2 boxes in original image pixels (640x480; the model saw 644x476, qwen2-vl coordinates):",
        "  1. cat: (64.0, 96.0)-(320.0, 288.0) [model wrote 100, 200, 500, 600]",
        "  2. cat: (576.0, 384.0)-(640.0, 432.0) [model wrote 900, 900, 1100, 800]; "
        "clamped to the image (was (576.0, 384.0)-(704.0, 432.0)); corners swapped",
    ]
    assert format_boxes([], (640, 480), (644, 476)) == [
        "0 boxes in original image pixels (640x480; the model saw 644x476)"
    ]


def test_no_boxes_still_writes_the_image(tmp_path: Path) -> None:
    image = random_image(123, 77, seed=4)
    boxes, lines = draw_answer("A random answer.", image, named("qwen2-vl"), resized(123, 77), tmp_path / "none.png")
    assert boxes == [] and lines[0].startswith("0 boxes")
    assert np.array_equal(np.asarray(Image.open(tmp_path / "none.png")), np.asarray(image))


@pytest.mark.parametrize(
    ("text", "convention"),
    [
        ("<ref>路牌</ref><quad>(100,200),(500,210),(490,400),(90,390)</quad>", "qwen-vl"),
        (
            "<|object_ref_start|>路牌<|object_ref_end|><|quad_start|>(100,200),(500,210),(490,400),(90,390)<|quad_end|>",
            "qwen2-vl",
        ),
    ],
)
def test_quads_keep_their_four_corners_in_original_pixels(text: str, convention: str) -> None:
    (quad,) = parse_boxes(text, named(convention), (2000, 1000), (1988, 1008))
    assert quad.kind == "quad" and quad.label == "路牌"
    assert quad.corners == ((200.0, 200.0), (1000.0, 210.0), (980.0, 400.0), (180.0, 390.0))
    assert quad.xyxy == (180.0, 200.0, 1000.0, 400.0)  # encloses the corners
    assert not quad.clamped


def test_a_quad_past_the_edge_is_clamped_and_drawn_as_a_polygon() -> None:
    (quad,) = parse_boxes(
        "<quad>(500,100),(1200,100),(1200,600),(500,600)</quad>", named("qwen-vl"), (200, 100), (196, 112)
    )
    assert quad.clamped and quad.unclamped == (100.0, 10.0, 240.0, 60.0)
    assert quad.corners == ((100.0, 10.0), (200.0, 10.0), (200.0, 60.0), (100.0, 60.0))
    drawn = np.asarray(draw_boxes(Image.new("RGB", (200, 100), "white"), [quad], line_width=1))
    assert (drawn[10, 120:190] != 255).any(axis=-1).all()  # the top edge is inked
    assert (drawn[30:40, 120:180] == 255).all()  # the inside is not


def test_qwen3_vl_json_boxes_are_on_the_0_to_1000_scale() -> None:
    """Qwen3-VL writes Qwen2.5-VL's JSON with relative numbers: the same answer about a 640 x 480
    photo (resized to 640 x 480 or any other size) maps by the original size alone."""
    text = '```json\n[{"bbox_2d": [100, 250, 500, 750], "label": "cat"}, {"point_2d": [500, 500]}]\n```'
    box, point = parse_boxes(text, named("qwen3-vl"), (640, 480), (672, 480))
    assert (box.label, xyxy(box)) == ("cat", (64, 120, 320, 360))
    assert point.kind == "point" and xyxy(point) == (320, 240, 320, 240)
    # Read as Qwen2.5-VL's absolute pixels the same numbers land elsewhere.
    (absolute, _) = parse_boxes(text, named("qwen2.5-vl"), (640, 480), (672, 480))
    assert xyxy(absolute) != xyxy(box)


@pytest.mark.parametrize(
    ("name", "answer", "shown"),
    [
        (
            "qwen2-vl",
            "It is <|object_ref_start|>the triangle<|object_ref_end|>"
            "<|box_start|>(190,690),(370,870)<|box_end|>.<|im_end|>",
            "It is the triangle [190,690 - 370,870].",
        ),
        (
            "qwen-vl",
            "It is <ref>the triangle</ref><box>(190,690),(370,870)</box>, x < y, <b>bold</b>",
            "It is the triangle [190,690 - 370,870], x < y, <b>bold</b>",
        ),
        ("qwen2.5-vl", '[{"bbox_2d": [1, 2, 3, 4], "label": "cat"}]', '[{"bbox_2d": [1, 2, 3, 4], "label": "cat"}]'),
    ],
)
def test_a_streamed_answer_reads_in_the_terminal_and_only_grows(name: str, answer: str, shown: str) -> None:
    """The terminal chat prints readable(text) as the text grows, one character at a time here
    (Qwen-VL-Chat's tags are plain text and arrive in pieces): what it printed is never taken back,
    and the whole answer reads as the user should see it."""
    from vlmserve.grounding import readable

    tags = grounding_convention(name).tags
    printed = ""
    for n in range(len(answer) + 1):
        now = readable(answer[:n], tags)
        assert now.startswith(printed), (answer[:n], printed, now)
        printed = now
    assert readable(answer, tags, complete=True) == shown and shown.startswith(printed)
