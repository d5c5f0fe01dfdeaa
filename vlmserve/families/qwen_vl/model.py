"""Qwen-VL-Chat: the Qwen-7B decoder (fused c_attn with bias, RMSNorm, w1 * silu(w2)
MLP, untied lm_head; 1-D RoPE with dynamic NTK and logn attention) whose 256 token positions
after each <img> take the Resampler's image embeddings. Parameter names are the published
checkpoint's (transformer.wte, transformer.h.N.*, transformer.visual.*, lm_head).

Positions: [3, num_tokens] int64. Row 0 is the rotary position. Row 1 + 1 is the sequence length
the reference had when it chose the token's rotary base (its kv_seq_len), from which dynamic NTK
takes the token's ntk_alpha. The reference chooses it once per generate() call, from the prompt
length, and reuses it (`_ntk_alpha_cached`) for every decoded token; a caller that wants that
gives decoded tokens row 1 = prompt length - 1. Keys already cached keep the rotation they were
written with, as in the reference's KV cache. Row 2 is unused. With seq_length 2048:

    prompt of 3000 tokens  -> rows 1 = 2999 -> alpha 3 for all of them (3000 <= 4096)
    decoded token 4096     -> row 1 = 2999 (reference: alpha 3 still) or 4096 (alpha 7)

NOTE: past seq_length a token's K depends on the length row 1 names, not only on the tokens
before it; a prefix cache may share K/V between prompts only where they agree on that length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.attention import AttentionBackend
from vlmserve.attention.layer import PagedAttention
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.config import ModelConfig, TextConfig
from vlmserve.families.common.model import VisionLanguageModel, untied_lm_head
from vlmserve.families.qwen_vl.config import QwenVLConfig, qwen_vl_config
from vlmserve.families.qwen_vl.visual import QwenVisionTransformer
from vlmserve.models.layers import Linear, RMSNorm, rotate_half
from vlmserve.models.loader import WeightTable
from vlmserve.models.parallel import VocabParallelEmbedding, refuse_tensor_parallel
from vlmserve.multimodal.inputs import MultiModalItem

# Lengths up to seq_length * 2**MAX_DOUBLINGS get their own alpha (2**41 - 1 at most).
MAX_DOUBLINGS = 40


def ntk_alpha(seq_len: int, seq_length: int) -> int:
    """The reference's rule, for a forward whose kv_seq_len is seq_len: 1 up to seq_length, 3 up to
    2 * seq_length, 7 up to 4 * seq_length, ... (2**ceil(log2(seq_len / seq_length) + 1) - 1)."""
    context_value = math.log(seq_len / seq_length, 2) + 1
    return max(2 ** math.ceil(context_value) - 1, 1)


def logn_factors(seq_length: int, size: int) -> torch.Tensor:
    """[size] float32: the query at position p is multiplied by entry p, log(p + 1) / log(seq_length)
    once p + 1 > seq_length, else 1 (the reference's logn_list, computed the same way)."""
    return torch.tensor([math.log(i, seq_length) if i > seq_length else 1 for i in range(1, size + 1)], device="cpu")


class QwenRotaryEmbedding:
    """cos / sin [num_tokens, rotary_dim] float32, each token with its own dynamic-NTK base.

    Rotary dimension i pairs with i + rotary_dim / 2 (rotate-half layout). With alpha from
    ntk_alpha, the base becomes base * alpha ** (rotary_dim / (rotary_dim - 2)). Alpha is always
    2**(k + 1) - 1 where k counts the doublings of seq_length below the length, so the inverse
    frequencies of every k are tabulated once (as the reference computes them, in float32) and each
    token picks its row on the device: no host sync."""

    def __init__(self, rotary_dim: int, base: float, seq_length: int, use_dynamic_ntk: bool) -> None:
        self.use_dynamic_ntk = use_dynamic_ntk
        exponents = torch.arange(0, rotary_dim, 2, device="cpu").float() / rotary_dim
        rows = []
        for k in range(MAX_DOUBLINGS + 1):
            alpha = 2 ** (k + 1) - 1
            rows.append(1.0 / ((base * alpha ** (rotary_dim / (rotary_dim - 2))) ** exponents))
        self.inv_freq = torch.stack(rows)  # [MAX_DOUBLINGS + 1, rotary_dim / 2]
        self.thresholds = seq_length * 2 ** torch.arange(MAX_DOUBLINGS, device="cpu")  # int64

    def doublings(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """k per token: how many of seq_length, 2 * seq_length, 4 * seq_length, ... are below its length."""
        if not self.use_dynamic_ntk:
            return torch.zeros_like(seq_lens)
        return (seq_lens[:, None] > self.thresholds.to(seq_lens.device)).sum(-1)

    def __call__(self, positions: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(positions.device)[self.doublings(seq_lens)]  # [num_tokens, rotary_dim / 2]
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_qwen_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim]: the first rotary_dim dimensions rotate, in float32 as
    the reference, then the result rounds back to x's dtype."""
    rotary_dim = cos.shape[-1]
    rot = x[..., :rotary_dim].float()
    rot = rot * cos[:, None] + rotate_half(rot) * sin[:, None]
    if rotary_dim == x.shape[-1]:
        return rot.to(x.dtype)
    return torch.cat((rot, x[..., rotary_dim:].float()), dim=-1).to(x.dtype)


class QWenAttention(nn.Module):
    def __init__(self, text: TextConfig, qwen: QwenVLConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = text.num_attention_heads
        self.head_dim = text.head_dim
        self.hidden_size = text.hidden_size
        # q, k and v in one matrix ([q | k | v], heads contiguous within each), always with a bias.
        self.c_attn = Linear(text.hidden_size, 3 * text.hidden_size, bias=True)
        self.c_proj = Linear(text.hidden_size, text.hidden_size, bias=not qwen.no_bias)
        self.paged_attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, backend)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        logn: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.c_attn(x).split(self.hidden_size, dim=-1)
        q = apply_qwen_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_qwen_rotary(k.view(n, self.num_heads, self.head_dim), cos, sin)
        if logn is not None:  # after the rotation, as the reference; keys are not scaled
            q = q * logn[:, None, None]
        return self.c_proj(self.paged_attn(q, k, v.view(n, self.num_heads, self.head_dim), meta))


class QWenMLP(nn.Module):
    """c_proj(w1(x) * silu(w2(x))): w2 is the gate."""

    def __init__(self, text: TextConfig, qwen: QwenVLConfig) -> None:
        super().__init__()
        bias = not qwen.no_bias
        self.w1 = Linear(text.hidden_size, text.intermediate_size, bias=bias)
        self.w2 = Linear(text.hidden_size, text.intermediate_size, bias=bias)
        self.c_proj = Linear(text.intermediate_size, text.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: w1 and w2 stay the checkpoint's two matrices (not fused), so that every weight
        # loads, and is reported missing, under its published name.
        return self.c_proj(self.w1(x) * F.silu(self.w2(x)))


class QWenBlock(nn.Module):
    def __init__(self, text: TextConfig, qwen: QwenVLConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.ln_1 = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.attn = QWenAttention(text, qwen, backend)
        self.ln_2 = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.mlp = QWenMLP(text, qwen)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        logn: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cos, sin, logn, meta)
        return x + self.mlp(self.ln_2(x))


class QWenModel(nn.Module):
    """`transformer` in the checkpoint: embedding, blocks, final norm and the vision tower."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        text, qwen = config.text, qwen_vl_config(config)
        self.qwen = qwen
        self.wte = VocabParallelEmbedding(text.vocab_size, text.hidden_size)
        self.h = nn.ModuleList([QWenBlock(text, qwen, backend) for _ in range(text.num_hidden_layers)])
        self.ln_f = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.visual = QwenVisionTransformer(qwen.visual, backend)
        self.rotary = QwenRotaryEmbedding(qwen.rotary_dim, text.rope_theta, qwen.seq_length, qwen.use_dynamic_ntk)
        # The reference tabulates 32767 positions; longer contexts extend the same formula.
        self.logn = logn_factors(qwen.seq_length, max(32767, text.max_position_embeddings))

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """inputs_embeds [num_tokens, hidden]; positions [3, num_tokens] (see the module docstring)
        or [num_tokens] (then each token's length is its position + 1) -> [num_tokens, hidden]."""
        if positions.ndim == 1:
            rotary_positions, seq_lens = positions, positions + 1
        else:
            rotary_positions, seq_lens = positions[0], positions[1] + 1
        cos, sin = self.rotary(rotary_positions, seq_lens)
        logn = None
        if self.qwen.use_logn_attn:
            logn = self.logn.to(rotary_positions.device)[rotary_positions].to(inputs_embeds.dtype)
        h = inputs_embeds
        for block in self.h:
            h = block(h, cos, sin, logn, meta)
        return self.ln_f(h)


class QWenLMHeadModel(VisionLanguageModel):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        refuse_tensor_parallel("Qwen-VL-Chat")
        super().__init__(config)
        qwen_vl_config(config)  # asserts a Qwen-VL config (model_type 'qwen')
        self.transformer = QWenModel(config, backend)
        # The published checkpoint is untied; a tied one gets its lm_head in tie_weights().
        self.lm_head = untied_lm_head(config.text)

    @staticmethod
    def decode_positions(start: int, end: int, mrope_delta: int, num_prompt_tokens: int) -> torch.Tensor:
        """Rows 0 and 2: the rotary position; row 1: prompt length - 1 for every generated token.
        The reference picks its dynamic-NTK rotary base from the prompt's length at prefill and
        keeps it while decoding (processor.py's docstring), so row 1 + 1 stays the prompt's length,
        also when a preempted request is recomputed."""
        positions = torch.arange(start + mrope_delta, end + mrope_delta).expand(3, -1).clone()
        positions[1] = num_prompt_tokens - 1
        return positions  # [3, end - start]

    # -- where the parts are (the checkpoint's `transformer`) ----------------------------------

    @property
    def decoder(self) -> nn.Module:
        return self.transformer

    @property
    def token_embedding(self) -> VocabParallelEmbedding:
        return self.transformer.wte

    def vision_encoder(self) -> nn.Module:
        return self.transformer.visual

    def encode(self, items: list[MultiModalItem], device: torch.device) -> torch.Tensor:
        """The images in one batch: [256 * len(items), hidden], each image's 256 rows for the 256
        positions between its <img> and </img>."""
        n_queries = qwen_vl_config(self.config).visual.n_queries
        bad = [item.length for item in items if item.length != n_queries]
        assert not bad, f"Qwen-VL images take {n_queries} placeholder tokens each, items have {bad}"
        pixel_values = torch.stack([item.pixel_values for item in items]).to(device, non_blocking=True)
        return self.transformer.visual(pixel_values).flatten(0, 1)

    # -- weights --------------------------------------------------------------------------------

    def weight_table(self) -> WeightTable:
        width = self.config.vision.embed_dim
        return WeightTable(
            # Module names are the checkpoint's; only conv1's kernel changes shape.
            reshape={"transformer.visual.conv1.weight": lambda w: w.reshape(width, -1)},
            ignore=self.ignores_weight,
        )
