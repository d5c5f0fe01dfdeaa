"""The Qwen3 decoder of Qwen3-VL: grouped-query attention without q/k/v bias whose queries and
keys are RMS-normalised per head before the rotary embedding, interleaved M-RoPE, and a SwiGLU
MLP or, in the MoE model, a routed mixture of SwiGLU experts. DeepStack: the vision tower's extra
features (layer_extras) are added to the hidden states after the first decoder layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.attention.layer import PagedAttention
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.config import TextConfig
from vlmserve.distributed import all_reduce
from vlmserve.families.qwen3_vl.config import MoeConfig, Qwen3VLFamilyConfig
from vlmserve.models.fused_decode import FusedDecode
from vlmserve.models.layers import Linear, RMSNorm, SiluAndMul, apply_rotary_qk
from vlmserve.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    head_parts,
    split_part,
)


def mrope_frequency_streams(mrope_section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """Which position stream (0 t, 1 h, 2 w) each of the head_dim / 2 rotary frequencies follows.

    Interleaved (Qwen3-VL), mrope_section (t, h, w) = (24, 20, 20): frequencies 0, 3, 6, ... follow
    t, 1, 4, ..., 58 follow h, 2, 5, ..., 59 follow w, and 60..63 (past 3 * 20) follow t again:
    t h w t h w ... t h w t t t t. Sectioned (Qwen2-VL): the first 24 follow t, the next 20 h,
    the last 20 w."""
    t, h, w = mrope_section
    # NOTE: on the CPU explicitly: the model is built under torch.device("meta").
    if not interleaved:
        return torch.cat([torch.full((n,), s, device="cpu") for s, n in enumerate(mrope_section)])
    streams = torch.zeros(t + h + w, dtype=torch.long, device="cpu")
    streams[1 : 3 * h : 3] = 1
    streams[2 : 3 * w : 3] = 2
    return streams


class InterleavedMRotary:
    """cos/sin [num_tokens, head_dim] of M-RoPE with each frequency following the stream
    mrope_frequency_streams gives it; both halves of the head use the same angles."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...], interleaved: bool) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
        self.streams = mrope_frequency_streams(mrope_section, interleaved)
        assert self.streams.numel() == head_dim // 2, "mrope_section sums to head_dim / 2 (checked when parsed)"

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, num_tokens] -> cos, sin [num_tokens, head_dim] in `dtype`."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [3, num_tokens, head_dim / 2]
        streams = self.streams.to(positions.device)
        freqs = freqs.gather(0, streams.expand(1, freqs.shape[1], -1)).squeeze(0)  # [num_tokens, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Qwen3Attention(nn.Module):
    def __init__(self, config: TextConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        # This rank's heads (all of them at tensor_parallel_size 1).
        *parts, self.num_heads, self.num_kv_heads = head_parts(
            config.num_attention_heads, config.num_key_value_heads, self.head_dim
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v fused into one matmul (no bias); loaded from q_proj / k_proj / v_proj.
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, parts, bias=False, names=("q", "k", "v"))
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, backend)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """keep: only these rows' outputs (every row's K and V are still written)."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # In place on the qkv output's views for bf16 on the CPU (models/layers.py): the kernels the
        # fused decode step (models/fused_decode.py) runs, so both give the same bits.
        q = self.q_norm.heads_(q.view(n, self.num_heads, self.head_dim))
        k = self.k_norm.heads_(k.view(n, self.num_kv_heads, self.head_dim))
        q, k = apply_rotary_qk(q, k, cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out if keep is None else out[keep])


class Qwen3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"the Qwen3 MLP expects hidden_act 'silu', config has {hidden_act!r}")
        i = intermediate_size
        self.gate_up_proj = ColumnParallelLinear.split(hidden_size, [i, i], bias=False, names=("0", "1"))
        self.down_proj = RowParallelLinear(i, hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


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


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, moe: MoeConfig | None, layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, backend)
        self.mlp: nn.Module = (
            Qwen3MoeBlock(config, moe)
            if moe is not None and moe.is_sparse(layer)
            else Qwen3MLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """keep: rows past attention (the last layer's, AttentionMetadata.output_rows)."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, meta, keep)
        x = (x if keep is None else x[keep]) + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, config: TextConfig, family: Qwen3VLFamilyConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen3DecoderLayer(config, family.moe, i, backend) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        assert config.mrope_section is not None
        self.rotary = InterleavedMRotary(
            config.head_dim, config.rope_theta, config.mrope_section, family.mrope_interleaved
        )
        # Decode steps in one kernel call where enable_fused_decode finds that it applies.
        self.fused_decode: FusedDecode | None = None

    def enable_fused_decode(self) -> bool:
        """Run pure decode steps through FusedDecode where it applies (called once the weights are
        in their final layout: models/build.py; never with MoE layers); whether it does."""
        self.fused_decode = FusedDecode.build(self, (Qwen3DecoderLayer, Qwen3Attention, Qwen3MLP))
        return self.fused_decode is not None

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        layer_extras: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs_embeds [num_tokens, hidden]; positions [3, num_tokens]; layer_extras
        [k, num_tokens, hidden] added after layers 0..k-1 -> [num_tokens, hidden]."""
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        if self.fused_decode is not None and layer_extras is None:
            out = self.fused_decode(inputs_embeds, cos, sin, meta)
            if out is not None:
                return out
        h = inputs_embeds
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            keep = meta.output_rows if i == last else None
            h = layer(h, cos, sin, meta, keep)
            if layer_extras is not None and i < layer_extras.shape[0]:
                # zero rows at text tokens: x + 0 is x exactly
                h = h + (layer_extras[i] if keep is None else layer_extras[i][keep])
        return self.norm(h)
