"""The Qwen3 decoder of Qwen3-VL (families/common/decoder.py with q/k norms and no q/k/v bias,
interleaved M-RoPE) and, in the MoE model, its routed mixture of SwiGLU experts. DeepStack: the
vision tower's extra features (layer_extras) are added to the hidden states after the first
decoder layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.config import TextConfig
from vlmserve.distributed import all_reduce
from vlmserve.families.common.decoder import MRotaryEmbedding, QwenAttention, QwenDecoder, QwenDecoderLayer, QwenMLP
from vlmserve.families.qwen3_vl.config import MoeConfig, Qwen3VLFamilyConfig
from vlmserve.models.layers import Linear
from vlmserve.models.parallel import ShardSpec, split_part


class Qwen3MoeExperts(nn.Module):
    """num_experts SwiGLU experts as two stacked weights (as published: fused gate/up and down,
    stored here in the [out, in] orientation of a Linear), run grouped by expert: the tokens are
    sorted by the expert they go to, and each expert that has any runs once on its rows.

    Tensor parallelism: tensor-parallel experts, not expert-parallel. Each rank holds every
    expert's 1/tp_size slice of the intermediate dimension (gate/up rows, down columns: the
    column/row split of a dense MLP) and the router is replicated, so every rank routes its
    tokens alike and the partial sums meet in one all_reduce per block (Qwen3MoeBlock). Expert
    parallelism would need an all-to-all dispatch of tokens to the ranks holding their experts
    and would load ranks as unevenly as the router picks experts; this split keeps each rank's
    weights and work an exact 1/tp_size whatever the routing, with the collective a dense MLP
    has."""

    def __init__(self, config: TextConfig, moe: MoeConfig) -> None:
        super().__init__()
        e, h = moe.num_experts, config.hidden_size
        part = split_part(moe.moe_intermediate_size, "moe_intermediate_size")
        i = part.size
        # What `vlmserve inspect` reads to count the parameters a token uses.
        self.num_experts, self.num_experts_per_tok = e, moe.num_experts_per_tok
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))  # [expert, gate | up (rank's rows), hidden]
        self.down_proj = nn.Parameter(torch.empty(e, h, i))  # [expert, hidden, intermediate (rank's)]
        self.tp_shards = {
            "gate_up_proj": ShardSpec(1, (part, part), ("gate", "up")),  # the shard ids of experts published one by one
            "down_proj": ShardSpec(2, (part,)),
        }

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [n, hidden]; expert_ids, weights [n, top_k] -> [n, hidden]: sum over each token's
        experts of weight * expert(x)."""
        top_k = expert_ids.shape[1]
        flat = expert_ids.flatten()  # [n * top_k]
        order = flat.argsort(stable=True)
        token_of = order // top_k  # the token each sorted slot belongs to
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()  # one host sync per layer
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            slots = order[start : start + count]
            rows = token_of[start : start + count]
            h = F.linear(x[rows], self.gate_up_proj[expert])
            gate, up = h.chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, rows, h * weights.flatten()[slots, None])
            start += count
        return out


class Qwen3MoeBlock(nn.Module):
    """The router (softmax over experts in float32, the top_k, renormalised to sum to 1 when
    norm_topk_prob) and the experts."""

    def __init__(self, config: TextConfig, moe: MoeConfig) -> None:
        super().__init__()
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = Qwen3MoeExperts(config, moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # [n, num_experts]
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)  # [n, top_k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # The experts' partial sums over this rank's slice of the intermediate dimension.
        return all_reduce(self.experts(x, expert_ids, weights.to(logits.dtype)))


def qwen3_decoder(config: TextConfig, family: Qwen3VLFamilyConfig, backend: AttentionBackend) -> QwenDecoder:
    """Qwen3 layers (q/k norms, no q/k/v bias), each with a SwiGLU MLP or, where the MoE model's
    layer is sparse, the routed experts; interleaved M-RoPE."""
    moe = family.moe
    layers = [
        QwenDecoderLayer(
            config,
            QwenAttention(config, backend, qkv_bias=False, qk_norm=True),
            Qwen3MoeBlock(config, moe)
            if moe is not None and moe.is_sparse(i)
            else QwenMLP(config.hidden_size, config.intermediate_size, config.hidden_act),
        )
        for i in range(config.num_hidden_layers)
    ]
    assert config.mrope_section is not None
    rotary = MRotaryEmbedding(config.head_dim, config.rope_theta, config.mrope_section, family.mrope_interleaved)
    return QwenDecoder(config, layers, rotary)
