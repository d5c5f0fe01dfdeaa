"""The Qwen2 decoder with M-RoPE (seed 001): grouped-query attention with q/k/v bias, RMSNorm,
SwiGLU, rotary frequencies split into temporal / height / width sections."""

from __future__ import annotations

import torch
from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.attention.layer import PagedAttention
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.config import TextConfig
from vlmserve.models.fused_decode import FusedDecode
from vlmserve.models.layers import RMSNorm, SiluAndMul, apply_rotary_qk
from vlmserve.models.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, head_parts


class MRotaryEmbedding:
    """cos/sin for M-RoPE. The head_dim / 2 frequencies are split by mrope_section, e.g.
    [16, 24, 24] for head_dim 128: the first 16 rotate by the temporal position, the next 24 by
    the height position, the last 24 by the width position; both halves of the head use the
    same angles (rotate-half layout). Text tokens have equal t/h/w positions, so for them this
    is ordinary 1-D RoPE."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...] | None) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
        self.mrope_section = list(mrope_section) if mrope_section else [head_dim // 2]

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, num_tokens] or [num_tokens] -> cos, sin [num_tokens, head_dim] in `dtype`."""
        if positions.ndim == 1:
            positions = positions.expand(3, -1)
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * inv_freq  # [3, num_tokens, head_dim / 2]
        sections = freqs.split(self.mrope_section, dim=-1)
        freqs = torch.cat([s[i % 3] for i, s in enumerate(sections)], dim=-1)  # [num_tokens, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Computed in float32, then rounded to the activation dtype before use (as the reference).
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Qwen2Attention(nn.Module):
    def __init__(self, config: TextConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        # This rank's heads (all of them at tensor_parallel_size 1).
        *parts, self.num_heads, self.num_kv_heads = head_parts(
            config.num_attention_heads, config.num_key_value_heads, self.head_dim
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v projections fused into one matmul; loaded from q_proj / k_proj / v_proj.
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, parts, bias=True, names=("q", "k", "v"))
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
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
        q, k = apply_rotary_qk(
            q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim), cos, sin
        )
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out if keep is None else out[keep])


class Qwen2MLP(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Qwen2 MLP expects hidden_act 'silu', config has {config.hidden_act!r}")
        i = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear.split(config.hidden_size, [i, i], bias=False, names=("0", "1"))
        self.down_proj = RowParallelLinear(i, config.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(config, backend)
        self.mlp = Qwen2MLP(config)
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
        x, h = self.post_attention_layernorm.add(x if keep is None else x[keep], attn)
        return x + self.mlp(h)


class Qwen2Model(nn.Module):
    def __init__(self, config: TextConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen2DecoderLayer(config, backend) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = MRotaryEmbedding(config.head_dim, config.rope_theta, config.mrope_section)
        # Decode steps in one kernel call where enable_fused_decode finds that it applies.
        self.fused_decode: FusedDecode | None = None

    def enable_fused_decode(self) -> bool:
        """Run pure decode steps through FusedDecode where it applies (called once the weights
        are in their final layout: models/build.py); whether it does."""
        self.fused_decode = FusedDecode.build(self, (Qwen2DecoderLayer, Qwen2Attention, Qwen2MLP))
        return self.fused_decode is not None

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """inputs_embeds: [num_tokens, hidden]; positions: [3, num_tokens] -> [num_tokens, hidden]."""
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        if self.fused_decode is not None:
            out = self.fused_decode(inputs_embeds, cos, sin, meta)
            if out is not None:
                return out
        h = inputs_embeds
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, meta, meta.output_rows if i == last else None)
        return self.norm(h)
