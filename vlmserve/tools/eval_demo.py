"""Measure the demo checkpoint on held-out scenes: accuracy per question kind and the share of
grounding boxes that overlap the true shape (IoU >= 0.5), greedy, through vlmserve's LLM.

    python -m vlmserve.tools.eval_demo [--scenes 200] [--dtype float32|bfloat16] [MODEL]

The scenes come from seeds the training never draws (EVAL_SEED + i; training draws seed * 1000003
+ step). Each scene is drawn at 448 x 448 (as examples/shapes.png) and asked one question of each
kind vlmserve.tools.scenes defines for it.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmserve.grounding import parse_boxes
from vlmserve.tools import scenes

EVAL_SEED = 1_000_000_000
PICTURE_SIZE = 448
GROUNDING_KINDS = ("ground", "ground_all")


@dataclass(frozen=True)
class Case:
    scene: scenes.Scene
    qa: scenes.QA
    image: Path


def held_out_cases(count: int, directory: Path, seed: int = EVAL_SEED) -> list[Case]:
    """`count` scenes drawn into `directory`, one Case per question that has an answer."""
    cases = []
    for i in range(count):
        rng = random.Random(seed + i)
        scene = scenes.random_scene(rng)
        image = directory / f"scene-{seed + i}.png"
        scenes.draw(scene, PICTURE_SIZE).save(image)
        cases += [Case(scene, qa, image) for qa in scenes.questions(scene, rng)]
    return cases


def messages(case: Case) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": str(case.image)}, {"type": "text", "text": case.qa.question}],
        }
    ]


_SIZE_WORDS = re.compile(r"\b(small|large)\s+")


def names_shapes(scene: scenes.Scene, text: str) -> bool:
    """The description names every shape by colour and kind, and no other shape."""
    plain = _SIZE_WORDS.sub("", text.lower())
    named = re.findall(r"\b(red|green|blue|yellow) (circle|square|triangle)\b", plain)
    return sorted(named) == sorted((s.colour, s.kind) for s in scene.shapes)


def box_hits(case: Case, text: str, size: tuple[int, int] = (PICTURE_SIZE, PICTURE_SIZE)) -> list[bool]:
    """For each shape the question asks to find, whether a box labelled with it overlaps its true
    box with IoU >= 0.5 (boxes mapped to the picture's pixels as the server and --draw-boxes map them)."""
    from vlmserve.registry import BY_NAME

    boxes = {b.label: b for b in parse_boxes(text, BY_NAME["qwen2_vl"].grounding, size, size)}
    wanted = case.scene.shapes
    if case.qa.kind == "ground":
        wanted = tuple(s for s in wanted if f"Find the {s.name}." == case.qa.question)
    hits = []
    for shape in wanted:
        box = boxes.get(f"the {shape.name}")
        truth = tuple(v * s for v, s in zip(shape.box, size * 2, strict=True))
        hits.append(box is not None and scenes.iou(box.xyxy, truth) >= 0.5)
    return hits


@dataclass
class Scores:
    right: dict[str, list[int]]
    boxes: list[int]

    def accuracy(self, kind: str) -> float:
        r, n = self.right[kind]
        return r / n if n else float("nan")

    @property
    def iou_share(self) -> float:
        return self.boxes[0] / self.boxes[1] if self.boxes[1] else float("nan")

    def table(self) -> str:
        lines = [f"{'kind':<16}{'right':>7}{'of':>6}{'accuracy':>10}"]
        for kind in sorted(self.right):
            r, n = self.right[kind]
            lines.append(f"{kind:<16}{r:>7}{n:>6}{r / n:>10.1%}")
        lines.append(f"{'boxes IoU>=0.5':<16}{self.boxes[0]:>7}{self.boxes[1]:>6}{self.iou_share:>10.1%}")
        return "\n".join(lines)


def score(cases: Sequence[Case], answers: Sequence[str]) -> Scores:
    """Exact answers per kind; for describe also `names` (every colour and shape named, sizes
    aside); for the grounding kinds, `ground`/`ground_all` right when every box hits, and every
    box counted in the IoU share."""
    right: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    boxes = [0, 0]

    def count(kind: str, ok: bool) -> None:
        right[kind][0] += ok
        right[kind][1] += 1

    for case, text in zip(cases, answers, strict=True):
        kind = case.qa.kind
        if kind in GROUNDING_KINDS:
            hits = box_hits(case, text)
            boxes[0] += sum(hits)
            boxes[1] += len(hits)
            count(kind, all(hits))
            continue
        count(kind, text.strip() == case.qa.answer)
        if kind == "describe":
            count("describe_names", names_shapes(case.scene, text))
    return Scores(dict(right), boxes)


def sampling_for(case: Case) -> Any:
    from vlmserve import SamplingParams

    grounding = case.qa.kind in GROUNDING_KINDS
    return SamplingParams(temperature=0, max_tokens=96 if grounding else 32, skip_special_tokens=not grounding)


def answer_logprob(llm: Any, cases: Sequence[Case]) -> float:
    """The mean log-probability per token the model gives the true answers (teacher-forced: each
    answer is the open assistant message of its conversation, read back with prompt_logprobs).
    Far more sensitive than exact answers: anything that blurs the picture (a wrong normalisation,
    patch order or rotary section) lowers it even where the greedy answer survives."""
    from vlmserve import SamplingParams

    conversations = [[*messages(c), {"role": "assistant", "content": c.qa.answer}] for c in cases]
    outputs = llm.chat(
        conversations,
        SamplingParams(max_tokens=1, prompt_logprobs=0, skip_special_tokens=False),
        add_generation_prompt=False,
        continue_final_message=True,
    )
    encode = llm.get_tokenizer().encode
    total, tokens = 0.0, 0
    for case, out in zip(cases, outputs, strict=True):
        answer = encode(case.qa.answer)
        ids, logprobs = out.prompt_token_ids, out.prompt_logprobs
        assert ids[-len(answer) :] == answer and logprobs is not None, "the prompt must end with the answer"
        for token, entry in zip(answer, logprobs[-len(answer) :], strict=True):
            assert entry is not None
            total += entry[token].logprob
            tokens += 1
    return total / tokens


def evaluate(llm: Any, cases: Sequence[Case]) -> Scores:
    outputs = llm.chat([messages(c) for c in cases], [sampling_for(c) for c in cases])
    return score(cases, [o.outputs[0].text for o in outputs])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlmserve.tools.eval_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="checkpoint (default: the demo checkpoint)")
    parser.add_argument("--scenes", type=int, default=200)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=EVAL_SEED)
    parser.add_argument("--show", type=int, default=0, help="print this many answers")
    args = parser.parse_args(argv)
    from vlmserve import LLM

    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, max_num_seqs=64)
    with tempfile.TemporaryDirectory() as tmp:
        cases = held_out_cases(args.scenes, Path(tmp), args.seed)
        outputs = llm.chat([messages(c) for c in cases], [sampling_for(c) for c in cases])
        answers = [o.outputs[0].text for o in outputs]
        logprob = answer_logprob(llm, cases)
    for case, text in list(zip(cases, answers, strict=True))[: args.show]:
        print(f"{case.qa.question!r}\n  want {case.qa.answer!r}\n  got  {text!r}")
    print(f"{args.scenes} held-out scenes (seeds {args.seed}..{args.seed + args.scenes - 1}), {len(cases)} questions")
    print(score(cases, answers).table())
    print(f"true answers' mean log-probability per token (teacher-forced): {logprob:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
