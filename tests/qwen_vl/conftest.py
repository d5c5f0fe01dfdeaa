"""A minimal Qwen-VL-Chat checkpoint directory: the tokenizer's files as the published
Qwen/Qwen-VL-Chat repository ships them (qwen.tiktoken, tokenizer_config.json with the remote
code's auto_map, generation_config.json), no weights."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from vlmserve.families.qwen_vl.tiny import QWEN_VL_GENERATION_CONFIG, QWEN_VL_TOKENIZER_CONFIG
from vlmserve.families.qwen_vl.tokenizer import QwenVLTokenizer
from vlmserve.tools.tiktoken_to_hf import qwen_tiktoken_path


def write_qwen_vl_tokenizer_dir(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(qwen_tiktoken_path(), out / "qwen.tiktoken")
    (out / "tokenizer_config.json").write_text(json.dumps(QWEN_VL_TOKENIZER_CONFIG, indent=2))
    (out / "generation_config.json").write_text(json.dumps(QWEN_VL_GENERATION_CONFIG, indent=2))
    return out


@pytest.fixture(scope="session")
def qwen_vl_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """$VLMSERVE_CACHE for these tests: the derived tokenizer.json is written there once."""
    cache = tmp_path_factory.mktemp("vlmserve-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLMSERVE_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="session")
def qwen_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen_vl_tokenizer_dir(tmp_path_factory.mktemp("ckpt") / "qwen-vl-chat")


@pytest.fixture(scope="session")
def qwen_vl_tokenizer(qwen_vl_dir: Path, qwen_vl_cache: Path) -> QwenVLTokenizer:
    return QwenVLTokenizer(qwen_vl_dir)
