"""A synthetic multimodal workload (in the spirit of vLLM's random-mm dataset): each request has
one random-noise image of a given size, a random text prompt of about `input_len` tokens, and
an output length drawn uniformly from a range; generation ignores eos, so every request
produces exactly its output length."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vlmserve.entrypoints.llm import LLM
from vlmserve.multimodal.inputs import ProcessedPrompt

# Plain words, so the prompt tokenizes to a predictable length.
_WORD_TEXT = (
    "the of and to in is it for on with as was at by an be this are from or have not but they "
    "his her she he we you all can had were one their which there been if more when will would "
    "who so what out up into than them some could time only new also about two other may then "
    "do any"
)
_WORDS = _WORD_TEXT.split()


@dataclass
class BenchRequest:
    index: int
    prompt: ProcessedPrompt
    output_len: int
    image_size: tuple[int, int]
    image: Image.Image | None = None  # the picture in the prompt (another engine is given the same one)


def make_workload(
    llm: LLM,
    num_requests: int,
    image_size: tuple[int, int],
    input_len: int,
    output_len: tuple[int, int],
    seed: int = 0,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    lo, hi = output_len
    requests = []
    for i in range(num_requests):
        pixels = np_rng.integers(0, 256, (image_size[1], image_size[0], 3), dtype=np.uint8)
        words = " ".join(rng.choice(_WORDS) for _ in range(input_len))
        image = Image.fromarray(pixels)
        messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": words}]}]
        requests.append(BenchRequest(i, llm.process_chat(messages), rng.randint(lo, hi), image_size, image))
    return requests


def max_model_len_for(image_size: int, input_len: int, max_output: int) -> int:
    """A context that holds a workload request: the image's tokens (one per 28x28 pixels), the
    prompt's words (up to two tokens each), the output, and the chat template."""
    return (image_size // 28) ** 2 + 2 * input_len + max_output + 64
