"""Pooling models (vLLM's runner="pooling"): a request runs its prompt only and returns a vector
made from the last layer's hidden states instead of sampling tokens.

Two tasks, each read from what the checkpoint declares:
- "embed": the hidden state (after the final norm) of the prompt's last token, L2-normalised,
  as sentence-transformers' last-token Pooling and Normalize modules make it (1_Pooling/config.json
  "pooling_mode": "lasttoken", and a Normalize module in modules.json). This is how the Qwen3
  embedding models (Qwen3-VL-Embedding) are pooled. Matryoshka `dimensions` keep the first values,
  then normalise.
- "score": a reranker in the yes/no next-token form of the Qwen3 rerankers (Qwen3-VL-Reranker):
  sigmoid(h . (W[yes] - W[no])) for h the last token's hidden state and W the lm_head, which is
  the probability of "yes" in a softmax over the two logits. A reranker checkpoint is published as
  a generation model, so this is asked for as vLLM asks for it: hf_overrides {"architectures":
  [...ForSequenceClassification], "classifier_from_token": ["no", "yes"]}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TASKS = ("embed", "score")
# vLLM's --runner values (engine/checkpoint.py resolve_pooler says what "auto" picks).
RUNNERS = ("auto", "generate", "pooling")


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's PoolingParams, the fields served here. dimensions: Matryoshka truncation (the first
    `dimensions` values, then normalised), for a model trained for it; normalize: None (the
    model's: True for an embedding model), or False for the raw pooled hidden state."""

    dimensions: int | None = None
    normalize: bool | None = None
    # "embed" or "score"; None: the model's task.
    task: str | None = None

    def verify(self, pooler: PoolerConfig) -> None:
        """ValueError naming what this model cannot do with these parameters."""
        task = self.task or pooler.task
        if task not in TASKS:
            raise ValueError(f"pooling task must be one of {list(TASKS)}, got {task!r}")
        if task != pooler.task:
            raise ValueError(f"this model serves the pooling task {pooler.task!r}, not {task!r}")
        if self.dimensions is None:
            return
        if task != "embed":
            raise ValueError("dimensions applies to embeddings only")
        if not pooler.matryoshka:
            raise ValueError(
                "this model does not support Matryoshka dimensions (its config declares none): "
                "leave dimensions out for its full embeddings"
            )
        if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int):
            raise ValueError(f"dimensions must be an integer, got {self.dimensions!r}")
        allowed = pooler.matryoshka_dimensions
        if allowed is not None and self.dimensions not in allowed:
            raise ValueError(f"dimensions {self.dimensions} is not one this model supports: {list(allowed)}")
        if not 1 <= self.dimensions <= pooler.hidden_size:
            raise ValueError(
                f"dimensions must be between 1 and the model's embedding size {pooler.hidden_size}, "
                f"got {self.dimensions}"
            )


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns its last hidden states into a request's output."""

    task: str  # "embed" or "score"
    hidden_size: int
    normalize: bool = True  # embed: L2-normalise by default
    # embed: whether `dimensions` may truncate (Matryoshka), and to which sizes (None: any up to
    # hidden_size).
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    # score: the tokens whose lm_head rows make the score, (negative, positive): ("no", "yes").
    score_tokens: tuple[str, str] | None = None

    @property
    def needs_lm_head(self) -> bool:
        return self.score_tokens is not None


def read_pooler_config(
    model_dir: Path, config_json: dict[str, Any], hidden_size: int, hf_overrides: dict[str, Any]
) -> PoolerConfig:
    """The pooler a checkpoint declares, with vLLM's hf_overrides over its config.json.

    Score (reranker): classifier_from_token of two tokens [negative, positive] (vLLM's form for the
    Qwen3 rerankers). Otherwise embed: last-token pooling (the only one served; a checkpoint whose
    sentence-transformers pooling says otherwise is refused), normalised where modules.json has a
    Normalize module or has no modules at all (vLLM's default for a decoder model's embeddings)."""
    config = {**config_json, **hf_overrides}
    tokens = config.get("classifier_from_token")
    if tokens is not None:
        if not (isinstance(tokens, list) and len(tokens) == 2 and all(isinstance(t, str) for t in tokens)):
            raise ValueError(
                f"classifier_from_token must name two tokens [negative, positive] (the Qwen3 rerankers': "
                f'["no", "yes"]), got {tokens!r}'
            )
        return PoolerConfig("score", hidden_size, score_tokens=(tokens[0], tokens[1]))
    pooling = _read_json(model_dir / "1_Pooling" / "config.json")
    mode = pooling.get("pooling_mode") if pooling else "lasttoken"
    if pooling and mode is None:  # the older sentence-transformers keys: one flag per mode
        flags = [key for key, on in pooling.items() if key.startswith("pooling_mode_") and on]
        mode = flags[0][len("pooling_mode_") :] if flags else None
    if mode not in ("lasttoken", "last_token"):
        raise ValueError(
            f"{model_dir / '1_Pooling' / 'config.json'}: pooling mode {mode!r} is not served; "
            "vlmserve pools the last token (the Qwen3 embedding models' pooling)"
        )
    modules = _read_json(model_dir / "modules.json")
    normalize = not modules or any(str(m.get("type", "")).endswith("Normalize") for m in modules)
    dims = config.get("matryoshka_dimensions")
    matryoshka = bool(config.get("is_matryoshka")) or dims is not None or _documents_matryoshka(config, pooling)
    return PoolerConfig(
        "embed",
        hidden_size,
        normalize=normalize,
        matryoshka=matryoshka,
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims is not None else None,
    )


def _documents_matryoshka(config: dict[str, Any], pooling: Any) -> bool:
    """Qwen3-VL-Embedding's config.json declares no Matryoshka fields, but its model card does:
    "supports user-defined output dimensions ranging from 64 to" the hidden size. Recognised by
    its layout: a Qwen3-VL model with sentence-transformers' last-token pooling."""
    return bool(pooling) and config.get("model_type") in ("qwen3_vl", "qwen3_vl_moe")


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
