"""What the conformance suite (test_conformance.py) knows of each registered family that the
registry does not say: which session fixture writes its tiny checkpoint, what it is checked
against (transformers' model of the same architecture, or for Qwen-VL-Chat, which transformers
has only as remote code, a dense transcription of the reference forward), and the checks it is
exempt from, each with its reason. Everything else comes from the family's registry entry.

The `family` fixture is module-scoped and parametrised over the registry, so pytest runs every
check of one family before the next: a family's checkpoint, reference, offline LLM and server are
set up once and dropped before the next family's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.conftest import random_image
from tests.reference import hf_mm_greedy, hf_mm_logits, hf_mm_prompt_ids
from vlmserve.family import ModelFamily
from vlmserve.registry import BY_NAME, FAMILIES


@dataclass(frozen=True)
class Case:
    checkpoint: str  # the session fixture (tests/conftest.py) that writes its tiny checkpoint
    hf_model: str | None  # the session fixture loading transformers' model on it; None: the dense reference
    server: str | None = None  # a session fixture serving it already (tests/conftest.py), if one does


CASES = {
    "qwen2_vl": Case("tiny_dir", "hf_model", server="server"),
    "qwen2_5_vl": Case("tiny25_dir", "hf25_model", server="qwen25_server"),
    "qwen3_vl": Case("tiny3_dir", "hf3_model", server="qwen3_server"),
    "qwen3_vl_moe": Case("tiny3_moe_dir", "hf3_moe_model"),
    "qwen3_5": Case("tiny35_dir", "hf35_model"),
    "qwen3_5_moe": Case("tiny35_moe_dir", "hf35_moe_model"),
    "qwen_vl": Case("tiny_qwen_vl_dir", None, server="qwen_server"),
}

_NO_TRANSFORMERS = (
    "transformers has no Qwen-VL-Chat (its checkpoint's remote code only); its tokenizer and prompts are checked "
    "against the reference's own vectors in tests/qwen_vl, its model against a dense transcription here"
)
_UNSHARDED = "{} does not shard its layers; the check is that it refuses tensor parallelism by name"
# (family, check) -> why the family does not take that check. A check a family is exempt from is
# skipped with the reason (tensor parallelism: the refusal itself is checked instead).
EXEMPTIONS = {
    ("qwen_vl", "config_against_transformers"): _NO_TRANSFORMERS,
    ("qwen_vl", "processor_against_transformers"): _NO_TRANSFORMERS,
    ("qwen_vl", "tensor_parallel"): _UNSHARDED.format("Qwen-VL-Chat"),
    ("qwen3_5", "tensor_parallel"): _UNSHARDED.format("Qwen3.5 (its Gated DeltaNet layers and their state)"),
    ("qwen3_5_moe", "tensor_parallel"): _UNSHARDED.format("Qwen3.5-MoE (its Gated DeltaNet layers and their state)"),
    ("qwen_vl", "handles_keep_original_size"): (
        "the list-of-dicts input's Qwen-VL-Chat form puts the shape of the 448 x 448 pixels after <img>, "
        "nothing of the image it was resized from: a request from those ids reports 448 x 448 as the original size"
    ),
}
CHECKS = (
    "config_against_transformers",
    "processor_against_transformers",
    "tensor_parallel",
    "handles_keep_original_size",
)


def exemption(family: ModelFamily, check: str) -> str | None:
    assert check in CHECKS, f"no check named {check!r}"
    return EXEMPTIONS.get((family.name, check))


def skip_if_exempt(family: ModelFamily, check: str) -> None:
    reason = exemption(family, check)
    if reason is not None:
        pytest.skip(f"{family.display_name} is exempt from {check}: {reason}")


@pytest.fixture(scope="module", params=[f.name for f in FAMILIES])
def family(request: pytest.FixtureRequest) -> ModelFamily:
    return BY_NAME[request.param]


@pytest.fixture(scope="module")
def case(family: ModelFamily) -> Case:
    assert family.name in CASES, f"the registry's {family.name} has no case in tests/families/conftest.py"
    return CASES[family.name]


@pytest.fixture(scope="module")
def model_dir(case: Case, request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(case.checkpoint)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The checks against the reference are `parity` tests (CI runs them again with the newest
    transformers) where the reference is transformers."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or "family" not in callspec.params or item.get_closest_marker("against_reference") is None:
            continue
        if CASES[callspec.params["family"]].hf_model is not None:
            item.add_marker(pytest.mark.parity)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "against_reference: compares with the family's reference (parity where that is transformers)"
    )


# -- pictures --------------------------------------------------------------------------------------

# Patch grids (rows, cols) the smart_resize processors keep as they are at the family's patch size
# (16 px: at least the published 65536 min_pixels), different in size and aspect, each larger
# than Qwen3-VL's 8 x 8 learned position grid; Qwen2.5-VL windows them partly.
GRIDS = {"first": (14, 20), "second": (22, 14), "square": (16, 16)}


@pytest.fixture(scope="module")
def pictures(family: ModelFamily, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PNG files by name, sized on the family's patch grid (Qwen-VL-Chat resizes every image to 448 x 448)."""
    from vlmserve.registry import load_model_config

    patch = load_model_config(model_dir / "config.json").vision.patch_size
    folder = tmp_path_factory.mktemp(f"pictures-{family.name}")
    paths = {}
    for seed, (name, (rows, cols)) in enumerate(GRIDS.items(), start=1):
        paths[name] = folder / f"{name}.png"
        random_image(patch * cols, patch * rows, seed=seed).save(paths[name])
    return paths


def opened(paths: list[Path]) -> list[Image.Image]:
    return [Image.open(p).convert("RGB") for p in paths]


# -- references ------------------------------------------------------------------------------------


class Reference:
    """Logits and greedy tokens for a prompt's token ids and its images (files), by the family's reference."""

    # torch.testing.assert_close's atol and rtol for float32 logits
    tolerance: ClassVar[tuple[float, float]]

    def logits(self, ids: list[int], images: list[Path], extra: list[int]) -> torch.Tensor:
        """[len(ids) + len(extra), vocab]: the prompt in one forward, then `extra` tokens after it."""
        raise NotImplementedError

    def greedy(self, ids: list[int], images: list[Path], max_new: int) -> list[int]:
        raise NotImplementedError


class TransformersReference(Reference):
    # Max absolute error 1e-4 (rtol 0): the per-family tests' bound since Qwen2-VL's.
    tolerance = (1e-4, 0.0)

    def __init__(self, hf_model: Any, model_dir: Path) -> None:
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.hf = hf_model
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        # Every family transformers has here takes Qwen2-VL's image processor at its own patch size.
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))

    def vision(self, images: list[Path]) -> dict[str, torch.Tensor]:
        return dict(self.image_processor(opened(images), return_tensors="pt")) if images else {}

    def prompt_ids(self, text: str, images: list[Path]) -> tuple[list[int], dict[str, torch.Tensor]]:
        """transformers' token ids for a prompt holding one <|image_pad|> per image, and its vision inputs."""
        return hf_mm_prompt_ids(self.tokenizer, self.image_processor, text, opened(images))

    def logits(self, ids: list[int], images: list[Path], extra: list[int]) -> torch.Tensor:
        return hf_mm_logits(self.hf, ids + extra, self.vision(images))

    def greedy(self, ids: list[int], images: list[Path], max_new: int) -> list[int]:
        return hf_mm_greedy(self.hf, ids, self.vision(images), max_new)


class DenseQwenVLReference(Reference):
    """tests/models/test_qwen_vl.py's transcription of Qwen-VL-Chat's forward (with its KV cache and
    its ntk_alpha kept from the prompt while decoding); images preprocessed as the seed describes."""

    # That file's bound for the whole model (its rotary runs in float32 at another place).
    tolerance = (2e-4, 1e-4)
    stop = frozenset({151643, 151644, 151645})  # <|endoftext|>, <|im_start|>, <|im_end|>

    def __init__(self, model_dir: Path) -> None:
        from safetensors.torch import load_file

        self.weights = {k: t.float() for k, t in load_file(str(model_dir / "model.safetensors")).items()}
        self.config = json.loads((model_dir / "config.json").read_text())

    def _start(self, ids: list[int], images: list[Path]) -> tuple[Any, torch.Tensor]:
        from tests.models.test_qwen_vl import DenseReference
        from tests.qwen_vl.test_processor import seed_pixels

        ref = DenseReference(self.weights, self.config, "cached")
        pixels = torch.stack([seed_pixels(p) for p in opened(images)]) if images else None
        return ref, ref(ref.prompt_embeds(ids, pixels))

    def _embed(self, token: int) -> torch.Tensor:
        return F.embedding(torch.tensor([token]), self.weights["transformer.wte.weight"])

    def logits(self, ids: list[int], images: list[Path], extra: list[int]) -> torch.Tensor:
        ref, logits = self._start(ids, images)
        return torch.cat([logits] + [ref(self._embed(t)) for t in extra])

    def greedy(self, ids: list[int], images: list[Path], max_new: int) -> list[int]:
        ref, logits = self._start(ids, images)
        tokens: list[int] = []
        while len(tokens) < max_new:
            tokens.append(int(logits[-1].argmax()))
            if tokens[-1] in self.stop:
                break
            logits = ref(self._embed(tokens[-1]))
        return tokens


@pytest.fixture(scope="module")
def reference(case: Case, model_dir: Path, request: pytest.FixtureRequest) -> Reference:
    if case.hf_model is None:
        return DenseQwenVLReference(model_dir)
    return TransformersReference(request.getfixturevalue(case.hf_model), model_dir)


# -- vlmserve's side ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def frontend(model_dir: Path):  # type: ignore[no-untyped-def]
    """The family's tokenizer, chat rendering and processor (no model)."""
    from vlmserve.api.frontend import load_frontend
    from vlmserve.engine.config import EngineConfig

    return load_frontend(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=4096))


def small_llm(model_dir: Path, **options: Any) -> Any:
    """The offline engine with a small token budget (image prompts are prefilled in chunks)."""
    from vlmserve import LLM

    return LLM(
        model_dir,
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=64,
        kv_cache_memory_gib=0.02,
        limit_mm_per_prompt={"image": 2},
        **options,
    )


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[Any]:
    import gc

    engine = small_llm(model_dir)
    yield engine
    del engine
    gc.collect()
