"""`vlmserve` as a user runs it: a real subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vlmserve import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]
SUNSET = REPO / "examples" / "sunset.png"


def vlmserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("vlmserve", path=str(Path(sys.executable).parent)) or shutil.which("vlmserve")
    assert exe, "the vlmserve console script is not installed (pip install -e .)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def test_chat_streams_the_same_answer_as_the_api(tiny_dir: Path) -> None:
    question = "What is in this picture?"
    result = vlmserve(
        "chat",
        str(tiny_dir),
        "--image",
        str(SUNSET),
        question,
        "--max-tokens",
        "12",
        "--temperature",
        "0",
        "--dtype",
        "float32",
    )
    assert result.returncode == 0, result.stderr
    llm = LLM(tiny_dir, dtype="float32", max_model_len=8192, kv_cache_memory_gib=0.01)
    messages = [
        {"role": "user", "content": [{"type": "image", "image": str(SUNSET)}, {"type": "text", "text": question}]}
    ]
    expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert result.stdout == expected + "\n"
    assert expected.strip()


@pytest.mark.slow
def test_chat_with_a_video_on_qwen2_5_vl(tiny25_dir: Path, tmp_path: Path) -> None:
    from tests.conftest import write_video

    clip = tmp_path / "clip.mp4"
    clip.write_bytes(write_video(24, fps=12, width=96, height=64))
    question = "What happens?"
    args = ("--video", str(clip), question, "--max-tokens", "6", "--temperature", "0", "--dtype", "float32")
    result = vlmserve("chat", str(tiny25_dir), *args)
    assert result.returncode == 0, result.stderr
    llm = LLM(tiny25_dir, dtype="float32", max_model_len=8192, kv_cache_memory_gib=0.01)
    messages = [
        {"role": "user", "content": [{"type": "video", "video": str(clip)}, {"type": "text", "text": question}]}
    ]
    (output,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6))
    assert [item.modality for item in output.mm_items] == ["video"]
    assert result.stdout == output.outputs[0].text + "\n"


def test_chat_reports_bad_images(tiny_dir: Path, tmp_path: Path) -> None:
    """A file that is there but is no image is found out from its header: given with --image, in
    one line before the model loads (tests/entrypoints/test_cli_conventions.py); attached in a
    conversation, in one line, and the conversation goes on without it."""
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not a picture")
    from tests.entrypoints.test_cli_conventions import vlmserve as with_input

    turns = f"/image {not_an_image}\nhi\n"
    result = with_input("chat", str(tiny_dir), "--dtype", "float32", "--max-tokens", "2", stdin=turns)
    assert result.returncode == 0, result.stderr
    assert f"error: /image {not_an_image}: cannot decode image (not one of BMP, GIF, JPEG, PNG, WEBP)" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout.strip()


# The default checkpoint written on first use, and what it answers: tests/tools/test_demo_model.py.


def test_make_tiny(tmp_path: Path) -> None:
    result = vlmserve("make-tiny", str(tmp_path / "t"), "--nested-config", "--untied", "--shards", "3")
    assert result.returncode == 0, result.stderr
    names = {p.name for p in (tmp_path / "t").iterdir()}
    assert {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
        "model-00003-of-00003.safetensors",
        "generation_config.json",
        "preprocessor_config.json",
    } <= names
