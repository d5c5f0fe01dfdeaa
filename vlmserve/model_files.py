"""Find a checkpoint's files: a local directory as published on the Hugging Face hub, or a hub id
downloaded through huggingface_hub. Imports no torch until weights are read: the command line
checks a model's path with it before anything heavy loads."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmserve.progress import progress

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# What a serving engine needs from a hub repository; original/*.pth and the like stay behind.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "merges.txt", "vocab.json", "*.tiktoken"]
# Older checkpoints (Qwen-VL-Chat among them) publish PyTorch pickles only: fetched when a
# repository has no safetensors.
BIN_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


def looks_like_hub_id(model: str | Path) -> bool:
    """`org/name` (letters, digits, '-', '_', '.') naming nothing on the local disk."""
    name = str(model)
    return re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None and not name.startswith(".") and not Path(name).exists()


def resolve_model_dir(model: str | Path, revision: str | None = None) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a directory but holds no config.json; is it a checkpoint?")
        return path
    name = str(model)
    if not looks_like_hub_id(name):
        raise FileNotFoundError(f"model {name!r}: no checkpoint directory there, and it is not a hub id (org/name)")
    return _download(name, revision)


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:  # A complete local copy needs no network.
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=True))
        if _has_weights(path):
            return path
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
        if not any(path.glob("*.safetensors")):
            path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS + BIN_PATTERNS))
        return path
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"model {repo_id!r}: no such repository on the Hugging Face hub") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as e:
        raise _unreachable(repo_id, "download it", e) from None


def config_json_path(path: str | Path) -> Path:
    """A config.json, or a checkpoint directory's; FileNotFoundError saying what to give."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no config.json there (give a config.json or a checkpoint directory)")
    return p


def hub_config(repo_id: str, revision: str | None = None) -> Path:
    """A hub repository's config.json alone (a few KB; the hub cache first), for sizing a model
    before downloading it. FileNotFoundError / OSError with one-line messages, as _download's."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return Path(hf_hub_download(repo_id, "config.json", revision=revision))
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"model {repo_id!r}: no such repository on the Hugging Face hub") from None
    except LocalEntryNotFoundError as e:  # offline, not cached (before EntryNotFoundError: it is one)
        raise _unreachable(repo_id, "fetch its config.json", e) from None
    except EntryNotFoundError:
        raise FileNotFoundError(f"model {repo_id!r}: the repository has no config.json") from None
    except (HfHubHTTPError, OSError) as e:
        raise _unreachable(repo_id, "fetch its config.json", e) from None


def _unreachable(repo_id: str, what: str, e: Exception) -> OSError:
    """The one-line error of a hub that cannot be reached (`what`: what could not be done)."""
    why = " ".join(str(e).split())  # huggingface_hub's messages run over several lines
    return OSError(
        f"model {repo_id!r}: could not {what} from the Hugging Face hub ({type(e).__name__}: "
        f"{why[:300]}{'...' if len(why) > 300 else ''}). Without network access, pass the path of a local "
        "checkpoint directory instead."
    )


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} must hold a JSON object")
    return data


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: those named by model.safetensors.index.json, else model.safetensors,
    else every *.safetensors file in the directory; without any, the PyTorch pickles
    (pytorch_model.bin.index.json, pytorch_model*.bin)."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file() and not any(model_dir.glob("*.safetensors")):
        index = model_dir / "pytorch_model.bin.index.json"
        if not index.is_file():
            files = sorted(model_dir.glob("pytorch_model*.bin"))
            if files:
                return files
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{model_dir}: shards named in the index are missing: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights found")
    return files


def weight_names(model_dir: Path) -> list[str] | None:
    """The names of the tensors iterate_weights will yield, from the safetensors headers alone
    (None for PyTorch pickles, which must be loaded to be read)."""
    from safetensors import safe_open

    names: list[str] = []
    for file in safetensors_files(model_dir):
        if file.suffix == ".bin":
            return None
        with safe_open(str(file), framework="pt") as f:
            names += f.keys()
    return names


def count_weights(model_dir: Path) -> int | None:
    """How many tensors iterate_weights will yield (None for PyTorch pickles)."""
    names = weight_names(model_dir)
    return None if names is None else len(names)


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    import torch
    from safetensors import safe_open

    for file in safetensors_files(model_dir):
        if file.suffix == ".bin":
            # weights_only: tensors and plain containers only, never arbitrary pickled objects.
            state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            continue
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


# -- writing (the tiny checkpoints) -----------------------------------------------------------

VOCAB_SIZE = 151936  # the embedding rows of the published checkpoints (padded past the tokenizer)


def save_weights(weights: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    from safetensors.torch import save_file

    metadata = {"format": "pt"}
    total = sum(t.numel() * t.element_size() for t in weights.values())
    names = list(weights)
    weight_map: dict[str, str] = {}
    shards = progress(desc="writing weights", total=total, unit="B", unit_scale=True, logger=logger)
    with shards:
        for k in range(max(1, num_shards)):
            shard_name = (
                "model.safetensors" if num_shards <= 1 else f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
            )
            shard = {n: weights[n] for n in names[k :: max(1, num_shards)]}
            save_file(shard, str(out / shard_name), metadata=metadata)
            weight_map |= dict.fromkeys(shard, shard_name)
            shards.update(sum(t.numel() * t.element_size() for t in shard.values()))
    if num_shards <= 1:
        return
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
