"""Which pooler a checkpoint gets (vlmserve/pooling.py, engine/checkpoint.py): what the published
layouts declare, vLLM's runner and hf_overrides over them, and PoolingParams' refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vlmserve.engine.checkpoint import resolve_pooler
from vlmserve.engine.config import EngineConfig
from vlmserve.pooling import PoolerConfig, PoolingParams, read_pooler_config
from vlmserve.registry import load_model_config

RERANKER = {"architectures": ["Qwen3VLForSequenceClassification"], "classifier_from_token": ["no", "yes"]}


def pooler(model_dir: Path, runner: str = "auto", **overrides: object) -> PoolerConfig | None:
    config = EngineConfig(model=str(model_dir), runner=runner, hf_overrides=dict(overrides))
    return resolve_pooler(config, model_dir, load_model_config(model_dir / "config.json"))


def test_the_published_layouts_declare_their_pooler(embedding_dir: Path, reranker_dir: Path, tiny3_dir: Path) -> None:
    embed = pooler(embedding_dir)
    assert embed == PoolerConfig("embed", 64, normalize=True, matryoshka=True)
    assert pooler(reranker_dir) is None  # published as a generation model: it generates unless told
    assert pooler(reranker_dir, **RERANKER) == PoolerConfig("score", 64, score_tokens=("no", "yes"))
    assert pooler(tiny3_dir) is None
    generic = pooler(tiny3_dir, runner="pooling")  # vLLM's default for a decoder: last token, normalised
    assert generic is not None and (generic.task, generic.normalize, generic.matryoshka) == ("embed", True, False)
    assert pooler(embedding_dir, runner="generate") is None
    with pytest.raises(ValueError, match="runner must be one of"):
        pooler(embedding_dir, runner="embed")


def test_a_checkpoint_without_lm_head_pools_and_its_modules_say_how(embedding_dir: Path, tmp_path: Path) -> None:
    """No sentence-transformers files, untied and no lm_head.weight: nothing to generate with, so
    it pools (normalised, vLLM's default; no Matryoshka declared); without a Normalize module its
    vectors are raw; a mean-pooling config is refused."""
    bare = tmp_path / "bare"
    shutil.copytree(embedding_dir, bare)
    (bare / "modules.json").unlink()
    shutil.rmtree(bare / "1_Pooling")
    assert pooler(bare) == PoolerConfig("embed", 64, normalize=True, matryoshka=False)
    shutil.copytree(embedding_dir / "1_Pooling", bare / "1_Pooling")
    modules = json.loads((embedding_dir / "modules.json").read_text())
    (bare / "modules.json").write_text(json.dumps([m for m in modules if not m["type"].endswith("Normalize")]))
    assert pooler(bare) == PoolerConfig("embed", 64, normalize=False, matryoshka=True)
    (bare / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with pytest.raises(ValueError, match="pooling mode 'mean_tokens' is not served"):
        pooler(bare)
    assert pooler(bare, runner="generate") is None


def test_pooling_params_name_what_the_model_cannot_do() -> None:
    embed = PoolerConfig("embed", 64, matryoshka=True, matryoshka_dimensions=(16, 32, 64))
    PoolingParams(dimensions=32).verify(embed)
    with pytest.raises(ValueError, match=r"dimensions 24 is not one this model supports: \[16, 32, 64\]"):
        PoolingParams(dimensions=24).verify(embed)
    with pytest.raises(ValueError, match="does not support Matryoshka dimensions"):
        PoolingParams(dimensions=32).verify(PoolerConfig("embed", 64))
    with pytest.raises(ValueError, match="serves the pooling task 'embed', not 'score'"):
        PoolingParams(task="score").verify(embed)
    with pytest.raises(ValueError, match="between 1 and the model's embedding size 64"):
        PoolingParams(dimensions=65).verify(PoolerConfig("embed", 64, matryoshka=True))
    with pytest.raises(ValueError, match="classifier_from_token must name two tokens"):
        read_pooler_config(Path("."), {}, 64, {"classifier_from_token": ["yes"]})
