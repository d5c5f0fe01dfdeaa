"""The Qwen2 and Qwen3 decoders, one implementation: grouped-query attention over the paged KV
cache with q, k and v fused (Qwen2: with a bias; Qwen3: without, its queries and keys
RMS-normalised per head before the rotary), a SwiGLU MLP (or a family's mixture of experts in
its place), RMSNorm before each, and M-RoPE with the frequencies in sections (Qwen2-VL) or
interleaved (Qwen3-VL, Qwen3.5)."""

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


def mrope_frequency_streams(mrope_section: tuple[int, ...] | None, interleaved: bool, half: int) -> torch.Tensor:
    """Which position stream (0 t, 1 h, 2 w) each of the `half` rotary frequencies follows.

    Sectioned (Qwen2-VL), mrope_section (16, 24, 24): the first 16 follow t, the next 24 h, the
    last 24 w (a fourth section would follow t again). Interleaved (Qwen3-VL), (24, 20, 20):
    frequencies 0, 3, 6, ... follow t, 1, 4, ..., 58 follow h, 2, 5, ..., 59 follow w, and
    60..63 (past 3 * 20) follow t again: t h w t h w ... t h w t t t t. No mrope_section: all
    follow t (text tokens have t = h = w, so that is 1-D RoPE)."""
    # NOTE: on the CPU explicitly: the model is built under torch.device("meta").
    if mrope_section is None:
        return torch.zeros(half, dtype=torch.long, device="cpu")
    if not interleaved:
        return torch.cat([torch.full((n,), s % 3, device="cpu") for s, n in enumerate(mrope_section)])
    t, h, w = mrope_section
    streams = torch.zeros(t + h + w, dtype=torch.long, device="cpu")
    streams[1 : 3 * h : 3] = 1
    streams[2 : 3 * w : 3] = 2
    return streams


class MRotaryEmbedding:
    """cos / sin [num_tokens, rotary_dim] of M-RoPE: rotary_dim / 2 frequencies, each following
    the position stream mrope_frequency_streams gives it; both halves of the rotated dimensions
    use the same angles (rotate-half layout)."""

    def __init__(
        self, rotary_dim: int, theta: float, mrope_section: tuple[int, ...] | None, interleaved: bool = False
    ) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device="cpu") / rotary_dim))
        self.streams = mrope_frequency_streams(mrope_section, interleaved, rotary_dim // 2)
        assert self.streams.numel() == rotary_dim // 2, "mrope_section sums to rotary_dim / 2 (checked when parsed)"

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, num_tokens] (or [num_tokens]: t = h = w) -> cos, sin [num_tokens, rotary_dim] in `dtype`."""
        if positions.ndim == 1:
            positions = positions.expand(3, -1)
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [3, num_tokens, rotary_dim / 2]
        streams = self.streams.to(positions.device)
        freqs = freqs.gather(0, streams.expand(1, freqs.shape[1], -1)).squeeze(0)  # [num_tokens, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Computed in float32, then rounded to the activation dtype before use (as the reference).
        return emb.cos().to(dtype), emb.sin().to(dtype)


class QwenAttention(nn.Module):
    """Qwen2's attention (qkv_bias) or Qwen3's (qk_norm)."""

    def __init__(self, config: TextConfig, backend: AttentionBackend, *, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        # This rank's heads (all of them at tensor_parallel_size 1).
        *parts, self.num_heads, self.num_kv_heads = head_parts(
            config.num_attention_heads, config.num_key_value_heads, self.head_dim
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v projections fused into one matmul; loaded from q_proj / k_proj / v_proj.
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, parts, bias=qkv_bias, names=("q", "k", "v"))
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.qk_norm = qk_norm
        if qk_norm:
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
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            # In place on the qkv output's views for bf16 on the CPU (models/layers.py): the kernels the
            # fused decode step (models/fused_decode.py) runs, so both give the same bits.
            q, k = self.q_norm.heads_(q), self.k_norm.heads_(k)
        q, k = apply_rotary_qk(q, k, cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out if keep is None else out[keep])


class QwenMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul (loaded from
    gate_proj / up_proj)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"the SwiGLU MLP expects hidden_act 'silu', config has {hidden_act!r}")
        i = intermediate_size
        self.gate_up_proj = ColumnParallelLinear.split(hidden_size, [i, i], bias=False, names=("0", "1"))
        self.down_proj = RowParallelLinear(i, hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class QwenDecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, self_attn: QwenAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
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


class QwenDecoder(nn.Module):
    """The embedding, the layers and the final norm (`model` in the checkpoint). Optional extras:
    per-layer additions to the hidden states (Qwen3-VL's DeepStack features)."""

    def __init__(self, config: TextConfig, layers: list[QwenDecoderLayer], rotary: MRotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = rotary
        # Decode steps in one kernel call where enable_fused_decode finds that it applies.
        self.fused_decode: FusedDecode | None = None

    def enable_fused_decode(self) -> bool:
        """Run pure decode steps through FusedDecode where it applies (called once the weights are
        in their final layout: models/build.py; never with MoE layers); whether it does."""
        self.fused_decode = FusedDecode.build(self, (QwenDecoderLayer, QwenAttention, QwenMLP))
        return self.fused_decode is not None

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        layer_extras: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs_embeds [num_tokens, hidden]; positions [3, num_tokens]; layer_extras
        [k, num_tokens, hidden] added after layers 0..k-1 -> [num_tokens, hidden] (the rows of
        meta.output_rows where it is set)."""
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
