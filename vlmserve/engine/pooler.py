"""The pooling runner's last step: the hidden state of each finished prompt's last token (after
the model's final norm) -> the request's vector (vlmserve/pooling.py says which tasks and why).

Embed: float32, the first `dimensions` values where asked (Matryoshka), L2-normalised unless the
request says not to. Score: sigmoid(h . (W[positive] - W[negative])) with the difference of the
two lm_head rows taken once, in float32, on every rank (each holds a slice of the vocabulary's
rows under tensor parallelism: the rows are summed over the ranks); the lm_head is dropped then,
as nothing else reads it."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from vlmserve.distributed.parallel_state import all_reduce, tp_rank
from vlmserve.models.base import VLModel
from vlmserve.pooling import PoolerConfig, PoolingParams


class Pooler:
    def __init__(self, config: PoolerConfig, model: VLModel, token_ids: tuple[int, int] | None) -> None:
        """token_ids: the score task's (negative, positive) token ids."""
        self.config = config
        self.score_vector: torch.Tensor | None = None
        if config.task == "score":
            assert token_ids is not None, "the score task needs its two tokens' ids"
            self.score_vector = _score_vector(model, token_ids)
            model.lm_head = None  # type: ignore[assignment]  # its two rows are all a reranker reads

    def __call__(self, hidden: torch.Tensor, params: list[PoolingParams]) -> list[torch.Tensor]:
        """hidden: [rows, hidden_size], one row per request -> one float32 CPU vector each."""
        h = hidden.float()
        if self.score_vector is not None:
            scores = torch.sigmoid(h @ self.score_vector).cpu()
            return [scores[i : i + 1] for i in range(len(params))]
        out = []
        for row, p in zip(h, params, strict=True):
            if p.dimensions is not None:
                row = row[: p.dimensions]
            if self.config.normalize if p.normalize is None else p.normalize:
                row = F.normalize(row, p=2, dim=-1)
            out.append(row.cpu())
        return out


def _score_vector(model: VLModel, token_ids: tuple[int, int]) -> torch.Tensor:
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, "weight"):
        raise ValueError("a reranker's score needs the model's lm_head (its 'yes' and 'no' rows)")
    weight: torch.Tensor = head.weight
    start = tp_rank() * weight.shape[0]  # each rank holds ceil(vocab / ranks) rows (models/parallel.py)
    vector = torch.zeros(weight.shape[1], dtype=torch.float32, device=weight.device)
    for sign, token in ((-1.0, token_ids[0]), (1.0, token_ids[1])):
        if start <= token < start + weight.shape[0]:
            vector += sign * weight[token - start].float()
    return all_reduce(vector)


def score_token_ids(model_dir: Path, load_tokenizer: object, tokens: tuple[str, str]) -> tuple[int, int]:
    """Each score token's id in the checkpoint's vocabulary; ValueError where one is not a token."""
    tokenizer = load_tokenizer(model_dir)  # type: ignore[operator]
    ids = []
    for token in tokens:
        encoded = tokenizer.encode(token)
        if len(encoded) != 1:
            raise ValueError(f"classifier_from_token {token!r} is {len(encoded)} tokens in this vocabulary, not one")
        ids.append(encoded[0])
    return ids[0], ids[1]
