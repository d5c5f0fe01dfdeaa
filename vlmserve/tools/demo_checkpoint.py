"""The demo checkpoint: a small Qwen2-VL trained by vlmserve.tools.train_demo on the shapes
vlmserve.tools.scenes draws, shipped in the package in a compact form (demo/demo_compact.safetensors:
every weight but the vocabulary tables, and only the rows of the few hundred token ids the
training used) and expanded on first use into the published Qwen2-VL layout under
$VLMSERVE_CACHE (default ~/.cache/vlmserve): config.json, the real Qwen tokenizer files, the chat
template, preprocessor_config.json and model.safetensors with the full 151,936-row embedding and
an untied lm_head whose unused rows all hold the trained "other" row.

See docs/demo-model.md for how it was made and what it can and cannot do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from vlmserve.families.qwen2_vl.tiny import TinySpec, write_tiny_qwen2_vl
from vlmserve.model_files import VOCAB_SIZE
from vlmserve.multimodal.image import ImageProcessorConfig

COMPACT_PATH = Path(__file__).parent / "demo" / "demo_compact.safetensors"
DEMO_CHECKPOINT_NAME = "demo-qwen2-vl-v1"
MARKER = "vlmserve_demo.json"

DEMO_SPEC = TinySpec(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    mrope_section=(4, 6, 6),  # sums to head_dim / 2 = 16, in Qwen2-VL-2B's proportions (16, 24, 24)
    # Qwen2-VL's base of 1e6 turns the height and width sections (frequency indices 4..15 of 16) by
    # under 0.04 rad per row and 0.0002 per column: across a 6 x 6 token grid the decoder could not
    # tell columns apart. At 10 they turn 0.56..0.27 and 0.24..0.12 rad per step.
    rope_theta=10.0,
    vision_depth=2,
    vision_embed_dim=96,
    vision_num_heads=2,
    vision_mlp_ratio=4,
    tie_word_embeddings=False,
    dtype="bfloat16",
)
PICTURE_SIDE = 168  # every picture is resized to about 168 x 168 pixels: 12 x 12 patches, 36 image tokens
IMAGE_TOKENS = (PICTURE_SIDE // 28) ** 2
DEMO_IMAGE_PROCESSOR = ImageProcessorConfig(min_pixels=PICTURE_SIDE**2, max_pixels=PICTURE_SIDE**2)
SYSTEM_PROMPT = "You are a helpful assistant."  # the chat template's default system message
# What a client is told the demo can be asked (the chat page's empty conversation): one question of
# each kind it was trained on, worded as in training, about the shapes of examples/shapes.png.
DEMO_ABOUT = (
    "The embedded demo checkpoint: a small Qwen2-VL trained on pictures of one to three coloured "
    "circles, squares and triangles (examples/shapes.png is one). It knows these questions and "
    "nothing else."
)
DEMO_QUESTIONS = (
    "What is in this picture?",
    "How many shapes are there?",
    "What colour is the square?",
    "What shape is the yellow one?",
    "Where is the green square?",
    "Find the yellow triangle.",
    "Find every shape.",
    "What does the text say?",
)

logger = logging.getLogger(__name__)


def expand(compact: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The compact weights in the published layout: the full embedding (unused rows zero) and the
    untied lm_head (unused rows = the trained row standing for them)."""
    used = compact["demo.used_ids"].long()
    rows, head_rows, other = compact["demo.embed_rows"], compact["demo.head_rows"], compact["demo.other_row"]
    embed = rows.new_zeros(VOCAB_SIZE, rows.shape[1])
    embed[used] = rows
    head = other.expand(VOCAB_SIZE, -1).clone()
    head[used] = head_rows
    weights = {name: t for name, t in compact.items() if not name.startswith("demo.")}
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    return weights


def write_layout(out: Path, weights: dict[str, torch.Tensor] | None, marker: dict[str, str] | None = None) -> Path:
    """The published layout for DEMO_SPEC into `out` (replaced atomically); random weights when
    `weights` is None (what the training starts from: it needs the config and the tokenizer)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=out.parent)) / "ckpt"
    pixels = {"min_pixels": DEMO_IMAGE_PROCESSOR.min_pixels, "max_pixels": DEMO_IMAGE_PROCESSOR.max_pixels}
    try:
        write_tiny_qwen2_vl(tmp, DEMO_SPEC, weights=weights, preprocessor=pixels)
        if marker is not None:  # written before the rename: a cache entry is whole or absent
            (tmp / MARKER).write_text(json.dumps(marker) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)
    return out


def is_demo_checkpoint(model_dir: str | Path) -> bool:
    """Whether a model directory is the demo checkpoint as demo_checkpoint_dir() expands it."""
    return (Path(model_dir) / MARKER).is_file()


def compact_digest(path: Path = COMPACT_PATH) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=12).hexdigest()


def demo_checkpoint_dir() -> Path:
    """The embedded default model: the demo checkpoint, expanded on first use (again whenever the
    shipped compact file changes)."""
    from safetensors.torch import load_file

    cache = Path(os.environ.get("VLMSERVE_CACHE", Path.home() / ".cache" / "vlmserve"))
    path = cache / DEMO_CHECKPOINT_NAME
    digest = compact_digest()
    marker = path / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("compact") == digest:
        return path
    logger.info("first use: expanding the demo checkpoint %s into %s", COMPACT_PATH.name, path)
    return write_layout(path, expand(load_file(str(COMPACT_PATH))), {"compact": digest})
