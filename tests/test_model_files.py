from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vlmserve.model_files import iterate_weights, resolve_model_dir, safetensors_files


def test_sharded_checkpoint_reads_every_shard(tiny_untied_dir: Path) -> None:
    files = safetensors_files(tiny_untied_dir)
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((tiny_untied_dir / "model.safetensors.index.json").read_text())
    names = {name for name, _ in iterate_weights(tiny_untied_dir)}
    assert names == set(index["weight_map"])
    assert "lm_head.weight" in names


def test_missing_shard_is_named(tiny_untied_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_untied_dir, broken)
    (broken / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        safetensors_files(broken)


def test_local_directory_and_errors(tiny_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_dir(str(tiny_dir)) == tiny_dir
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        resolve_model_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a hub id"):
        resolve_model_dir(tmp_path / "does-not-exist")


def test_hub_id_without_network_fails_clearly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # An empty cache and offline mode: what a user without network sees.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(OSError, match="could not download it from the Hugging Face hub.*local checkpoint"):
        resolve_model_dir("Qwen/Qwen2-VL-2B-Instruct")


def test_pytorch_pickles_load_when_there_are_no_safetensors(tiny_dir: Path, tmp_path: Path) -> None:
    """Qwen-VL-Chat publishes pytorch_model-0000N-of-0000M.bin shards with an index."""
    import torch
    from safetensors.torch import load_file

    ckpt = tmp_path / "bin"
    shutil.copytree(tiny_dir, ckpt, ignore=shutil.ignore_patterns("*.safetensors*"))
    weights = load_file(str(tiny_dir / "model.safetensors"))
    names = sorted(weights)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, part in halves.items():
        torch.save({n: weights[n] for n in part}, ckpt / file)
    index = {"weight_map": {n: f for f, part in halves.items() for n in part}}
    (ckpt / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    loaded = dict(iterate_weights(ckpt))
    assert sorted(loaded) == names and all(torch.equal(loaded[n], weights[n]) for n in names)
