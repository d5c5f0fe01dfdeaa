"""Shared fixtures: tiny checkpoints written once per session, and transformers' reference
implementation loaded on the same files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
from PIL import Image

from vlmserve.families.qwen2_vl.tiny import TinySpec, write_tiny_qwen2_vl
from vlmserve.registry import BY_NAME

if TYPE_CHECKING:
    from tests.api.conftest import Server

torch.set_num_threads(2)

# The Triton attention kernels run on the CPU under the interpreter. Triton reads TRITON_INTERPRET
# when a kernel is defined, its own library's included (triton.language), so it is set before
# anything imports triton; TRITON_INTERPRET=0 skips the tests that need it.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Markers by the folder a test lives in (registered in pyproject.toml), so that `pytest -m "not
# server"` and the like select a part of the suite. `slow`, and `server` on the few tests outside
# tests/api that start a server, are marked in their modules.
FOLDER_MARKERS = {
    "api": "server",  # the API process's tests: most start a real `vlmserve serve` process
    "kernels": "kernels",  # the compiled CPU kernels
    "attention": "kernels",  # the Triton kernels, run by the Triton interpreter
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(tests) and (marker := FOLDER_MARKERS.get(item.path.relative_to(tests).parts[0])):
            item.add_marker(marker)


@pytest.fixture(scope="session")
def triton_interpreter() -> None:
    pytest.importorskip("triton", reason="the triton package is not installed (pip install triton)")
    if os.environ["TRITON_INTERPRET"] != "1":
        pytest.skip("TRITON_INTERPRET is not 1: the Triton kernels are not run on the CPU")
    from triton.runtime.interpreter import InterpretedFunction

    from vlmserve.attention import triton_kernels

    assert isinstance(triton_kernels._paged_attention_kernel, InterpretedFunction), "triton was imported too early"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings, transformers 4.x flat config, one safetensors file, template in
    tokenizer_config.json: the Qwen2-VL-2B-Instruct layout."""
    return write_tiny_qwen2_vl(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2-vl")


@pytest.fixture(scope="session")
def tiny_untied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied lm_head, transformers 5 nested config, two shards with an index, template in
    chat_template.jinja."""
    return write_tiny_qwen2_vl(
        tmp_path_factory.mktemp("ckpt") / "tiny-qwen2-vl-untied",
        TinySpec(tie_word_embeddings=False),
        seed=1,
        nested_config=True,
        num_shards=2,
        chat_template_in="chat_template.jinja",
    )


@pytest.fixture(scope="session")
def hf_model(tiny_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_image_processor(tiny_dir: Path):  # type: ignore[no-untyped-def]
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """Smooth random content (noise plus gradients), so resizing has structure to preserve."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1), (x + y) * 127 / max(width + height, 1)], -1)
    pixels = np.clip(base + rng.normal(0, 40, (height, width, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    return image if mode == "RGB" else image.convert(mode)


@pytest.fixture(scope="session")
def images() -> dict[str, Image.Image]:
    return {
        "wide": random_image(150, 100, seed=1),
        "tall": random_image(70, 190, seed=2),
        "small": random_image(40, 30, seed=3),
        "odd": random_image(123, 77, seed=4),
    }


@pytest.fixture(scope="session")
def small_vocab_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_dir cut to a few tokens (tests/beam_oracle.py), where every beam can be enumerated:
    the offline and the served beam search tests."""
    from tests.beam_oracle import write_small_vocab

    return write_small_vocab(tiny_dir, tmp_path_factory.mktemp("ckpt") / "tiny-small-vocab")


@pytest.fixture(scope="session")
def small_vocab_hf(small_vocab_dir: Path):  # type: ignore[no-untyped-def]
    from tests.beam_oracle import load_hf

    return load_hf(small_vocab_dir)


@pytest.fixture(scope="session")
def tiny25_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2.5-VL (QWEN2_5_VL_SPEC): four vision blocks, windows of 4 x 4 merged tokens in blocks
    0 and 2, whole frames in 1 and 3; tied embeddings, transformers 4.x flat config, one
    safetensors file: the Qwen2.5-VL-3B-Instruct layout."""
    from vlmserve.families.qwen2_vl.tiny import QWEN2_5_VL_SPEC

    return write_tiny_qwen2_vl(tmp_path_factory.mktemp("ckpt") / "tiny-qwen2_5-vl", QWEN2_5_VL_SPEC)


@pytest.fixture(scope="session")
def hf25_model(tiny25_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tiny25_dir), dtype=torch.float32).eval()


# -- test videos ---------------------------------------------------------------------------------


def frame_color(index: int) -> tuple[int, int, int]:
    """The colour of the top half of test-video frame `index` (modulo 512): its three octal
    digits, in steps of 32 in red, green and blue, far enough apart to survive a lossy codec."""
    return 32 * (index % 8) + 16, 32 * (index // 8 % 8) + 16, 32 * (index // 64 % 8) + 16


def color_index(top_half_rgb: np.ndarray) -> int:
    """The frame index frame_color encoded, read back from the mean colour of a frame's top half."""
    digits = [round((float(v) - 16) / 32) for v in top_half_rgb.reshape(-1, 3).mean(axis=0)]
    return digits[0] + 8 * digits[1] + 64 * digits[2]


def video_frame(index: int, width: int, height: int) -> np.ndarray:
    """[height, width, 3] uint8: frame_color(index) on top, a gradient below (so resizing has
    structure to work on)."""
    frame = np.empty((height, width, 3), np.uint8)
    frame[: height // 2] = frame_color(index)
    gradient = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    frame[height // 2 :] = np.broadcast_to(gradient, (height - height // 2, width, 3)).astype(np.uint8)
    return frame


def write_video(
    num_frames: int,
    fps: int = 24,
    width: int = 64,
    height: int = 48,
    codec: str = "mpeg4",
    container: str = "mp4",
    codec_options: dict[str, str] | None = None,
    gop_size: int | None = None,
) -> bytes:
    """A small video made with PyAV whose frame i shows video_frame(i)."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.bit_rate = 2_000_000
        if gop_size is not None:
            stream.codec_context.gop_size = gop_size
        if codec_options:
            stream.codec_context.options = codec_options
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(video_frame(i, width, height), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


@pytest.fixture(scope="session")
def tiny_qwen_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen-VL-Chat in its published layout (qwen.tiktoken, remote-code config, seq_length 64 so
    that dynamic NTK and logn act on tiny prompts)."""
    from vlmserve.families.qwen_vl.tiny import write_tiny_qwen_vl

    return write_tiny_qwen_vl(tmp_path_factory.mktemp("ckpt") / "tiny-qwen-vl")


# -- Qwen3-VL ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-VL (tiny.TinySpec): 3 decoder layers, a 3-block tower with DeepStack features after
    blocks 0 and 1, an 8 x 8 learned position grid; tied embeddings, the published nested config."""
    from vlmserve.families.qwen3_vl.tiny import write_tiny_qwen3_vl

    return write_tiny_qwen3_vl(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-vl")


@pytest.fixture(scope="session")
def tiny3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-VL-MoE (tiny.MOE_SPEC): 8 experts, 2 per token, layer 1 dense; untied, two shards."""
    from vlmserve.families.qwen3_vl.tiny import MOE_SPEC, write_tiny_qwen3_vl

    return write_tiny_qwen3_vl(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-vl-moe", MOE_SPEC, seed=1, num_shards=2)


@pytest.fixture(scope="session")
def embedding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-VL-Embedding's layout (make-tiny --preset embedding): no lm_head, sentence-transformers'
    files, so runner "auto" pools it."""
    return BY_NAME["qwen3_vl"].write_tiny(
        tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-vl-embedding", preset="embedding"
    )


@pytest.fixture(scope="session")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-VL-Reranker's layout (make-tiny --preset reranker): served with RERANKER_OVERRIDES."""
    return BY_NAME["qwen3_vl"].write_tiny(
        tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-vl-reranker", preset="reranker", seed=1
    )


@pytest.fixture(scope="session")
def hf3_model(tiny3_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(str(tiny3_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf3_moe_model(tiny3_moe_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import Qwen3VLMoeForConditionalGeneration

    return Qwen3VLMoeForConditionalGeneration.from_pretrained(str(tiny3_moe_dir), dtype=torch.float32).eval()


# -- Qwen3.5 -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny35_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3.5 (tiny.TinySpec): 4 layers, linear and full attention alternating, Qwen3-VL's tower
    without DeepStack; tied embeddings, the published nested config."""
    from vlmserve.families.qwen3_5.tiny import write_tiny_qwen3_5

    return write_tiny_qwen3_5(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3.5")


@pytest.fixture(scope="session")
def tiny35_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3.5-MoE (tiny.MOE_SPEC): 6 experts, 2 per token, and a shared expert in every layer;
    experts one by one as published; untied."""
    from vlmserve.families.qwen3_5.tiny import MOE_SPEC, write_tiny_qwen3_5

    return write_tiny_qwen3_5(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3.5-moe", MOE_SPEC)


@pytest.fixture(scope="session")
def hf35_model(tiny35_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(str(tiny35_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf35_moe_model(tiny35_moe_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import Qwen3_5MoeForConditionalGeneration

    return Qwen3_5MoeForConditionalGeneration.from_pretrained(str(tiny35_moe_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llm(tiny_dir: Path):  # type: ignore[no-untyped-def]
    """The offline engine on tiny_dir at the `server` fixture's model length and KV cache: the
    server's tests compare with it, the token handles' tests run on it."""
    from vlmserve import LLM

    return LLM(tiny_dir, dtype="float32", max_model_len=4096, kv_cache_memory_gib=0.05)


# -- servers ---------------------------------------------------------------------------------------
# Shared by the whole session (tests/serve and the families' conformance suite): a start costs an
# API and an engine process importing torch and loading the model. Tests on them assert on their
# own requests only (metrics as differences, the engine's pid unchanged across their own
# requests); a module that needs other flags or kills the engine starts its own.


@pytest.fixture(scope="session")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from tests.api.conftest import start_server

    s = start_server(tiny_dir, tmp_path_factory.mktemp("server"))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def qwen_server(tiny_qwen_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Qwen-VL-Chat with the default flags."""
    from tests.api.conftest import start_server

    s = start_server(tiny_qwen_vl_dir, tmp_path_factory.mktemp("qwen-vl-server"))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def qwen25_server(tiny25_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Qwen2.5-VL with the default flags."""
    from tests.api.conftest import start_server

    s = start_server(tiny25_dir, tmp_path_factory.mktemp("qwen25-server"))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def qwen25_tool_server(tiny25_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Qwen2.5-VL (its template takes tools) with auto tool choice, the hermes tool parser, the
    qwen3 reasoning parser and a store of two responses: the tool calls' and the responses' tests.
    (The tool parser reads only answers to requests with tools; the store holds only responses.)"""
    from tests.api.conftest import start_server

    tools = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    store = ("--responses-store-max-entries", "2")
    s = start_server(tiny25_dir, tmp_path_factory.mktemp("qwen25-tool-server"), *tools, *store)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def qwen3_server(tiny3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Qwen3-VL with the default flags."""
    from tests.api.conftest import start_server

    s = start_server(tiny3_dir, tmp_path_factory.mktemp("qwen3-server"))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def embedding_server(embedding_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny Qwen3-VL-Embedding served (runner "auto" pools it), at most 8 prompts at once in
    512 tokens: the pooling server's tests and docs/server.md's embeddings example."""
    from tests.api.conftest import start_server

    flags = ("--max-num-seqs", "8", "--max-model-len", "512")
    s = start_server(embedding_dir, tmp_path_factory.mktemp("embedding-server"), *flags)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def demo_checkpoint_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The embedded demo checkpoint served as "demo" and under the name `vlmserve serve` with no
    model gives it (its folder's): README's openai snippet and the demo model's tests."""
    from tests.api.conftest import start_server
    from vlmserve.tools.demo_checkpoint import demo_checkpoint_dir

    demo = demo_checkpoint_dir()
    names = ("--served-model-name", "demo", demo.name)
    s = start_server(demo, tmp_path_factory.mktemp("demo-server"), *names, served_model_name=None)
    yield s
    s.stop()
