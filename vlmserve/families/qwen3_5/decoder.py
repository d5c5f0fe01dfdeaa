"""The Qwen3.5 decoder: most layers mix tokens with Gated DeltaNet linear attention (per-request
conv and recurrent states of fixed size, vlmserve.attention.state), every few a gated full
attention over the paged KV cache (an output gate from the query projection, q/k RMS norms,
interleaved M-RoPE on the first rotary_dim dimensions of each head). RMS norms scale by
(1 + weight), as published; the MLP is Qwen3's SwiGLU, or in the MoE model Qwen3-VL-MoE's routed
experts plus a shared expert gated by a sigmoid per token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.attention.layer import PagedAttention
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.attention.state import SequenceState
from vlmserve.attention.torch_backend import write_kv
from vlmserve.config import TextConfig
from vlmserve.families.common.decoder import MRotaryEmbedding, QwenMLP
from vlmserve.families.qwen3_5.config import Qwen35FamilyConfig
from vlmserve.families.qwen3_5.deltanet import (
    MAX_RECURRENT_ROWS,
    causal_conv1d,
    chunk_gated_delta_rule,
    recurrent_rows,
)
from vlmserve.families.qwen3_vl.config import MoeConfig
from vlmserve.families.qwen3_vl.decoder import Qwen3MoeBlock
from vlmserve.models.layers import Linear, apply_rotary
from vlmserve.models.parallel import VocabParallelEmbedding


class OffsetRMSNorm(nn.Module):
    """RMS norm scaled by (1 + weight), all in float32, rounded once at the end."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMS norm of the DeltaNet output per value head, scaled, then gated by silu(z)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: TextConfig, family: Qwen35FamilyConfig) -> None:
        super().__init__()
        f = family
        self.f = f
        # q | k | v (the conv's channels), z (the output gate), b (write strength), a (decay), fused;
        # loaded from in_proj_qkv / in_proj_z / in_proj_b / in_proj_a.
        self.split = [f.conv_dim, f.value_dim, f.num_v_heads, f.num_v_heads]
        self.in_proj = Linear(config.hidden_size, sum(self.split), bias=False)
        self.conv1d = nn.Conv1d(f.conv_dim, f.conv_dim, f.conv_kernel_dim, groups=f.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(f.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(f.num_v_heads))
        self.norm = GatedRMSNorm(f.value_head_dim, config.rms_norm_eps)
        self.out_proj = Linear(f.value_dim, config.hidden_size, bias=False)
        # Per request: the conv's last kernel - 1 inputs, and the recurrent state (float32).
        self.state = SequenceState(
            [
                ((f.conv_dim, f.conv_kernel_dim - 1), None),
                ((f.num_v_heads, f.key_head_dim, f.value_head_dim), torch.float32),
            ]
        )

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, conv_dim] after the conv -> q, k [n, num_k_heads, key_head_dim], v [n, num_v_heads, value_head_dim]."""
        f = self.f
        q, k, v = mixed.split([f.key_dim, f.key_dim, f.value_dim], dim=-1)
        n = mixed.shape[0]
        return (
            q.reshape(n, f.num_k_heads, f.key_head_dim),
            k.reshape(n, f.num_k_heads, f.key_head_dim),
            v.reshape(n, f.num_v_heads, f.value_head_dim),
        )

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert meta.state_slots is not None and meta.state_slots_host is not None and meta.has_initial_state is not None
        assert self.state.states, "state cache not bound: the engine allocates it before the first step"
        f = self.f
        mixed, z, b, a = self.in_proj(x).split(self.split, dim=-1)
        beta = b.sigmoid()  # [n, num_v_heads]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # log decay, <= 0
        windows, states = self.state.states  # [slots, conv_dim, kernel - 1], [slots, v_heads, key, value]
        self.state.reset([s for s, init in zip(meta.state_slots_host, meta.has_initial_state, strict=True) if not init])
        weight = self.conv1d.weight[:, 0]  # [conv_dim, kernel]
        out = torch.empty(x.shape[0], f.num_v_heads, f.value_head_dim, dtype=torch.float32, device=x.device)
        loc = meta.query_start_loc
        # A decode step's one token, and a few that continue a state (a verify step's k + 1), in
        # the recurrent form, all sequences at once; longer runs and first chunks in the chunked form.
        recurrent = [
            i
            for i in range(meta.num_seqs)
            if loc[i + 1] - loc[i] == 1 or (loc[i + 1] - loc[i] <= MAX_RECURRENT_ROWS and meta.has_initial_state[i])
        ]
        self.state.position_states = {}
        if recurrent:
            spans = [(loc[i], loc[i + 1]) for i in recurrent]
            slots = [meta.state_slots_host[i] for i in recurrent]
            wanted = meta.keep_position_states
            keep = None if wanted is None else [wanted[i] for i in recurrent]
            kept = recurrent_rows(mixed, g, beta, weight, self._heads, windows, states, spans, slots, out, keep)
            self.state.position_states = {slots[i]: tensors for i, tensors in kept.items()}
        chunked = sorted(set(range(meta.num_seqs)) - set(recurrent))
        for i in chunked:
            start, end = loc[i], loc[i + 1]
            slot = meta.state_slots_host[i]
            conv, window = causal_conv1d(mixed[start:end], windows[slot], weight)
            q, k, v = self._heads(conv)
            out[start:end], state = chunk_gated_delta_rule(q, k, v, g[start:end], beta[start:end], states[slot])
            windows[slot] = window
            states[slot] = state
        core = self.norm(out.to(x.dtype).reshape(-1, f.value_head_dim), z.reshape(-1, f.value_head_dim))
        return self.out_proj(core.reshape(x.shape[0], f.value_dim))


class GatedAttention(nn.Module):
    def __init__(self, config: TextConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # Per head [query | gate] (2 * head_dim), then k, then v; loaded from q_proj / k_proj / v_proj.
        self.qkv_proj = Linear(config.hidden_size, 2 * self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, backend)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = q_gate.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = _partial_rotary(self.q_norm(q), cos, sin)
        k = _partial_rotary(self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = self.attn(q.contiguous(), k, v, meta)  # [n, q_size]
        return self.o_proj(out * torch.sigmoid(gate.reshape(n, self.q_size)))

    def store_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> None:
        """Only the keys and values of x's rows, written at meta's slots (no attention read): a
        draft head's cache kept up where its output is not needed."""
        assert self.attn.kv_cache is not None, "KV cache not bound"
        n = x.shape[0]
        _, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        k = _partial_rotary(self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)), cos, sin)
        write_kv(k.contiguous(), v.reshape(n, self.num_kv_heads, self.head_dim), self.attn.kv_cache, meta)


def _partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dimensions of each head of x [n, heads, head_dim]."""
    r = cos.shape[-1]
    return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)


class Qwen35SparseMoeBlock(Qwen3MoeBlock):
    """Qwen3-VL-MoE's router and grouped experts, plus a shared SwiGLU expert every token goes
    through, its output scaled by sigmoid(shared_expert_gate(x)) (one scalar per token)."""

    def __init__(self, config: TextConfig, moe: MoeConfig, shared_intermediate_size: int) -> None:
        super().__init__(config, moe)
        self.shared_expert = QwenMLP(config.hidden_size, shared_intermediate_size, config.hidden_act)
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [n, 1] * [n, hidden]
        return super().forward(x) + shared


class Qwen35DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, family: Qwen35FamilyConfig, layer: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.linear = family.layer_types[layer] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(config, family)
        else:
            self.self_attn = GatedAttention(config, backend)
        self.mlp: nn.Module = (
            Qwen35SparseMoeBlock(config, family.moe, family.shared_expert_intermediate_size)
            if family.moe is not None
            else QwenMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        )
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, meta) if self.linear else self.self_attn(h, cos, sin, meta))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35Model(nn.Module):
    def __init__(self, config: TextConfig, family: Qwen35FamilyConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen35DecoderLayer(config, family, i, backend) for i in range(config.num_hidden_layers)]
        )
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        assert config.mrope_section is not None
        self.rotary = MRotaryEmbedding(
            family.rotary_dim, config.rope_theta, config.mrope_section, family.mrope_interleaved
        )

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """inputs_embeds [num_tokens, hidden]; positions [3, num_tokens] -> [num_tokens, hidden]."""
        cos, sin = self.rotary(positions, inputs_embeds.dtype)  # [num_tokens, rotary_dim]
        h = inputs_embeds
        for layer in self.layers:
            h = layer(h, cos, sin, meta)
        return self.norm(h)
