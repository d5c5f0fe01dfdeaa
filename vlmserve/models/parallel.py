"""Tensor-parallel layers (Megatron's split, as vLLM does it): each process of a tensor-parallel
group holds its rank's shard of every large weight and runs the collectives that make the
sharded forward equal to the unsharded one.

- ColumnParallelLinear: output rows split across ranks; the output stays split (the next layer,
  attention heads or a RowParallelLinear, consumes the rank's slice). A fused projection is a
  list of parts (q, k, v; gate, up), each split on its own, so every rank holds [q_r | k_r | v_r].
- RowParallelLinear: input columns split; partial products summed by all_reduce; the bias is
  added by rank 0 only (once, not tp_size times).
- VocabParallelEmbedding: rows split by vocabulary range; each rank looks up the ids in its
  range (zero elsewhere), all_reduce sums the ranks' rows.
- ParallelLMHead: the same rows as logits; all_gather along the vocabulary.

Which slice of a checkpoint tensor a parameter holds is its ShardSpec, kept in its module's
`tp_shards` (by parameter name); models/loader.py narrows each checkpoint tensor with it, so no
process ever holds more than its shard plus one checkpoint tensor. At tp_size() == 1 every spec
is the whole tensor and every collective is the identity: the layers compute exactly what
models.layers.Linear and nn.Embedding compute.

The layers are models.layers.Linear (bind_linear_op binds the faster CPU kernel into them);
quant/int8.py keeps their `collective` and `bias_in_product` when it replaces them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.distributed import all_gather, all_reduce, tp_rank, tp_size
from vlmserve.models.layers import Linear


@dataclass(frozen=True)
class Part:
    """One part of a (possibly fused) dimension: `full` entries in the checkpoint, of which this
    rank holds `size` starting at `start` (past the end of the checkpoint's entries: zero rows,
    the padding of a vocabulary not divisible by tp_size)."""

    full: int
    size: int
    start: int


def split_part(full: int, what: str) -> Part:
    """An even split of `full` entries across the ranks."""
    size = tp_size()
    if full % size:
        raise ValueError(f"tensor parallelism: {what} ({full}) is not divisible by tensor_parallel_size {size}")
    return Part(full, full // size, tp_rank() * (full // size))


def head_parts(
    num_heads: int, num_kv_heads: int, head_dim: int, where: str = "the decoder"
) -> tuple[Part, Part, Part, int, int]:
    """The q, k and v parts of a fused qkv projection and the (query, KV) heads this rank holds.
    Query heads are split; KV heads too, or, with fewer KV heads than ranks, each rank holds the
    one KV head its query heads read (replicated over tp_size / num_kv_heads ranks, as vLLM)."""
    size, rank = tp_size(), tp_rank()
    split_part(num_heads, f"{where}'s number of attention heads")
    q = split_part(num_heads * head_dim, f"{where}'s query width")
    if num_kv_heads >= size:
        split_part(num_kv_heads, f"{where}'s number of key/value heads")
        kv = split_part(num_kv_heads * head_dim, f"{where}'s key/value width")
        local_kv = num_kv_heads // size
    else:
        if size % num_kv_heads:
            raise ValueError(
                f"tensor parallelism: {where}'s {num_kv_heads} key/value heads cannot be replicated evenly over "
                f"tensor_parallel_size {size} (it must divide or be a multiple of the KV heads)"
            )
        kv = Part(num_kv_heads * head_dim, head_dim, (rank * num_kv_heads // size) * head_dim)
        local_kv = 1
    return q, kv, kv, num_heads // size, local_kv


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter is cut from the checkpoint along `dim`: the checkpoint tensor is its
    parts concatenated; the parameter holds each part's rank slice, concatenated. `names` are the
    loader's shard ids of the parts (a fused parameter loaded part by part: "q", "k", "v")."""

    dim: int
    parts: tuple[Part, ...]
    names: tuple[str, ...] = ()

    def full_size(self, shard: str | None) -> int:
        """The checkpoint tensor's size along dim: one part's, or all parts'."""
        if shard is not None:
            return self.parts[self.names.index(shard)].full
        return sum(p.full for p in self.parts)

    def narrow(self, tensor: torch.Tensor, shard: str | None, dim: int) -> tuple[int, int, torch.Tensor]:
        """The rank's slice of a checkpoint tensor (one part's, when `shard` names it; else all
        parts') and where it goes in the parameter: (start, size) along `dim`, the slice."""
        if shard is not None:
            index = self.names.index(shard)
            offset = sum(p.size for p in self.parts[:index])
            part = self.parts[index]
            return offset, part.size, _take(tensor, dim, 0, part)
        pieces, base = [], 0
        for part in self.parts:
            pieces.append(_take(tensor, dim, base, part))
            base += part.full
        return 0, sum(p.size for p in self.parts), torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]


def _take(tensor: torch.Tensor, dim: int, base: int, part: Part) -> torch.Tensor:
    """part's rows of the checkpoint's [base, base + part.full) along dim, zero-padded past it."""
    if part.start == 0 and part.size == part.full == tensor.shape[dim] and base == 0:
        return tensor
    have = max(0, min(part.size, part.full - part.start))
    piece = tensor.narrow(dim, base + part.start, have) if have else tensor.narrow(dim, 0, 0)
    if have < part.size:
        shape = list(piece.shape)
        shape[dim] = part.size - have
        piece = torch.cat([piece, piece.new_zeros(shape)], dim)
    return piece


def spec_of(module: nn.Module, param_name: str) -> ShardSpec | None:
    shards: dict[str, ShardSpec] = getattr(module, "tp_shards", {})
    return shards.get(param_name)


def reduce_sum(y: torch.Tensor) -> torch.Tensor:
    return all_reduce(y)


@dataclass(frozen=True)
class GatherVocab:
    """The ranks' logit columns concatenated, the padding past vocab_size dropped."""

    vocab_size: int

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return y
        return all_gather(y, dim=-1)[..., : self.vocab_size]


class ColumnParallelLinear(Linear):
    """y_r = x @ W_r.T + b_r: this rank's rows of each part of the output (see the module doc)."""

    collective: Callable[[torch.Tensor], torch.Tensor] | None = None
    bias_in_product = True

    def __init__(
        self, input_size: int, parts: Sequence[Part], bias: bool, names: Sequence[str] = (), **kwargs: object
    ) -> None:
        super().__init__(input_size, sum(p.size for p in parts), bias=bias, **kwargs)  # type: ignore[arg-type]
        spec = ShardSpec(0, tuple(parts), tuple(names))
        self.tp_shards = {"weight": spec, "bias": spec} if bias else {"weight": spec}

    @classmethod
    def split(cls, input_size: int, output_sizes: Sequence[int], bias: bool, names: Sequence[str] = ()):  # type: ignore[no-untyped-def]
        """Each of output_sizes (one part, or the halves of a fused gate/up) split evenly."""
        return cls(input_size, [split_part(n, "a column-parallel output size") for n in output_sizes], bias, names)


class RowParallelLinear(Linear):
    """y = sum_r x_r @ W_r.T (+ b on rank 0): x arrives split along its last dimension (a
    ColumnParallelLinear's output, attention's local heads), the output is whole on every rank."""

    collective: Callable[[torch.Tensor], torch.Tensor] | None = staticmethod(reduce_sum)
    bias_in_product: bool

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        part = split_part(input_size, "a row-parallel input size")
        super().__init__(part.size, output_size, bias=bias)
        self.tp_shards = {"weight": ShardSpec(1, (part,))}  # the bias is whole on every rank
        self.bias_in_product = tp_rank() == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.op(x, self.weight, self.bias if self.bias_in_product else None))


def vocab_part(vocab_size: int) -> Part:
    """This rank's vocabulary rows: ceil(vocab / tp_size) each, the last rank's padded."""
    size = -(-vocab_size // tp_size())
    return Part(vocab_size, size, tp_rank() * size)


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding over this rank's vocabulary rows (its num_embeddings is the rank's count)."""

    def __init__(self, vocab_size: int, embedding_dim: int) -> None:
        part = vocab_part(vocab_size)
        super().__init__(part.size, embedding_dim)
        self.vocab_size = vocab_size
        self.vocab_start = part.start
        self.tp_shards = {"weight": ShardSpec(0, (part,))}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(mine, local, 0), self.weight)  # [num_tokens, hidden]
        return all_reduce(out.masked_fill_(~mine[..., None], 0))


class ParallelLMHead(Linear):
    """Logits [num_tokens, vocab]: this rank's vocabulary rows, gathered across the ranks. A tied
    checkpoint shares the VocabParallelEmbedding's shard (the same rows)."""

    bias_in_product = True

    def __init__(self, hidden_size: int, vocab_size: int, **kwargs: object) -> None:
        part = vocab_part(vocab_size)
        super().__init__(hidden_size, part.size, bias=False, **kwargs)  # type: ignore[arg-type]
        self.collective: Callable[[torch.Tensor], torch.Tensor] | None = GatherVocab(vocab_size)
        self.tp_shards = {"weight": ShardSpec(0, (part,))}

    @classmethod
    def tied_to(cls, embedding: VocabParallelEmbedding) -> ParallelLMHead:
        head = cls(embedding.embedding_dim, embedding.vocab_size, device="meta")
        head.weight = embedding.weight
        return head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.collective is not None
        return self.collective(self.op(x, self.weight, None))


def refuse_tensor_parallel(family: str) -> None:
    """For a family whose layers are not sharded: a clear error at build time under tp_size() > 1."""
    if tp_size() > 1:
        raise ValueError(
            f"{family} does not support tensor parallelism (tensor_parallel_size {tp_size()}); "
            "run it with tensor_parallel_size 1"
        )
