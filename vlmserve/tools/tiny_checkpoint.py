"""The checkpoints vlmserve writes for itself on first use, cached under $VLMSERVE_CACHE (default
~/.cache/vlmserve): the embedded default (the demo checkpoint, a small Qwen2-VL trained on
synthetic shapes, expanded from the compact form the package ships: vlmserve.tools.demo_checkpoint)
and the benchmark-size random-weight one."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from vlmserve.families.qwen2_vl.tiny import BENCH_SPEC, TinySpec, write_tiny_qwen2_vl

TINY_CHECKPOINT_NAME = "tiny-qwen2-vl-v1"
BENCH_CHECKPOINT_NAME = "bench-qwen2-vl-v1"

logger = logging.getLogger(__name__)


def _cached_checkpoint(name: str, spec: TinySpec) -> Path:
    cache = Path(os.environ.get("VLMSERVE_CACHE", Path.home() / ".cache" / "vlmserve"))
    path = cache / name
    if not (path / "vlmserve_tiny.json").is_file():
        logger.info("first use: writing the random-weight checkpoint %s to %s", name, path)
        write_tiny_qwen2_vl(path, spec)
    return path


def default_checkpoint_dir() -> Path:
    """The embedded default model: the demo checkpoint, expanded on first use."""
    from vlmserve.tools.demo_checkpoint import demo_checkpoint_dir

    return demo_checkpoint_dir()


def tiny_checkpoint_dir() -> Path:
    """A tiny random Qwen2-VL (TinySpec()), written on first use: the default before the demo
    checkpoint, kept for what measures the machinery rather than answers (bench.api_memory)."""
    return _cached_checkpoint(TINY_CHECKPOINT_NAME, TinySpec())


def bench_checkpoint_dir() -> Path:
    """The benchmark-size random Qwen2-VL (BENCH_SPEC), written on first use."""
    return _cached_checkpoint(BENCH_CHECKPOINT_NAME, BENCH_SPEC)
