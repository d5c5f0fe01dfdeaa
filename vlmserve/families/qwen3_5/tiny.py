"""Write a tiny random-weight Qwen3.5 checkpoint in the published Hugging Face layout: nested
config.json (text_config with layer_types and full_attention_interval, the linear_* sizes, and
rope_parameters holding mrope_section, mrope_interleaved and partial_rotary_factor; vision_config
without DeepStack), weights under the published names (linear_attn.in_proj_qkv / in_proj_z /
in_proj_b / in_proj_a / conv1d / dt_bias / A_log / norm / out_proj, self_attn.q_proj holding
query and gate per head). The MoE preset (`make-tiny --arch qwen3_5_moe`) writes Qwen3.5-MoE:
every layer's MLP as mlp.gate (the router), experts one by one (mlp.experts.<e>.gate_proj /
up_proj / down_proj, as published and as transformers saves them), mlp.shared_expert.* and
mlp.shared_expert_gate. Both write the multi-token-prediction head as published (mtp.*, one
full-attention layer: text_config.mtp_num_hidden_layers 1). The chat template is Qwen3.5's
published one (chat_template.jinja, as the published checkpoints ship it: thinking, tools in
Qwen3.5's XML format); tokenizer and processor configs are Qwen3-VL's (the published Qwen3.5
vocabulary is larger; a tiny checkpoint names its special ids in config.json)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from vlmserve.families.common.tiny import (
    RandomWeights,
    decoder_norm_weights,
    in_dtype,
    qwen3_attention_weights,
    swiglu_weights,
    tiny_info,
)
from vlmserve.families.qwen3_5.chat_template import QWEN3_5_CHAT_TEMPLATE
from vlmserve.families.qwen3_vl.tiny import text_config_json, vision_config_json, vision_weights, write_qwen3_vl_files
from vlmserve.model_files import VOCAB_SIZE


@dataclass(frozen=True)
class TinySpec:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    full_attention_interval: int = 2  # linear, full, linear, full
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    partial_rotary_factor: float = 0.25  # 16 rotary dimensions of 64, as published (64 of 256)
    mrope_section: tuple[int, int, int] = (3, 3, 2)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    vision_depth: int = 2
    vision_hidden_size: int = 32
    vision_num_heads: int = 2
    vision_intermediate_size: int = 64
    num_position_embeddings: int = 64
    tie_word_embeddings: bool = True
    dtype: str = "bfloat16"
    # MoE (Qwen3.5-MoE) when num_experts > 0: 2 * moe_intermediate_size differs from hidden_size
    # and from the shared expert's width, so a weight loaded transposed or into the wrong expert fails.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 24
    shared_expert_intermediate_size: int = 40

    @property
    def layer_types(self) -> list[str]:
        return [
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)
        ]


MOE_SPEC = TinySpec(num_experts=6, tie_word_embeddings=False)
# The benchmark checkpoint: a 2B-class width (hidden 2048, MLP 6144, the full vocabulary) with
# transformers' default Qwen3.5 head shapes (16 query / 4 KV heads of 256; Gated DeltaNet 16 key /
# 32 value heads of 128), 4 layers (linear, full, linear, full) and a narrow vision tower.
BENCH_SPEC = TinySpec(
    hidden_size=2048,
    intermediate_size=6144,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    mrope_section=(11, 11, 10),
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    vision_depth=2,
    vision_hidden_size=256,
    vision_num_heads=4,
    vision_intermediate_size=1024,
)
# Qwen3.5-2B's language model as published (24 layers, every fourth full attention: 8 query / 2
# KV heads of 256; Gated DeltaNet 16 key / 16 value heads of 128; hidden 2048, MLP 6144, tied)
# with BENCH_SPEC's narrow vision tower and the Qwen3-VL vocabulary (151,936 rows, not the
# published 248,320): the verify-step benchmark's Qwen3.5 (vlmserve.bench.verify_cost).
QWEN3_5_2B_SPEC = replace(
    BENCH_SPEC,
    num_hidden_layers=24,
    full_attention_interval=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    linear_num_value_heads=16,
)
PRESETS = {
    ("qwen3_5", "tiny"): TinySpec(),
    ("qwen3_5", "bench"): BENCH_SPEC,
    ("qwen3_5", "2b"): QWEN3_5_2B_SPEC,
    ("qwen3_5_moe", "tiny"): MOE_SPEC,
}


def config_json(spec: TinySpec) -> dict[str, object]:
    rope = {"rope_type": "default", "rope_theta": 10000000, "mrope_interleaved": True}
    text = text_config_json(spec, "qwen3_5_text", rope | {"partial_rotary_factor": spec.partial_rotary_factor})
    text |= {
        "full_attention_interval": spec.full_attention_interval,
        "layer_types": spec.layer_types,
        "linear_conv_kernel_dim": spec.linear_conv_kernel_dim,
        "linear_key_head_dim": spec.linear_key_head_dim,
        "linear_num_key_heads": spec.linear_num_key_heads,
        "linear_num_value_heads": spec.linear_num_value_heads,
        "linear_value_head_dim": spec.linear_value_head_dim,
        "mtp_num_hidden_layers": 1,  # the published head (mtp.*), of one layer
        "mtp_use_dedicated_embeddings": False,
    }
    if spec.num_experts:
        del text["intermediate_size"]  # no dense MLP
        text |= {
            "model_type": "qwen3_5_moe_text",
            "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.num_experts_per_tok,
            "moe_intermediate_size": spec.moe_intermediate_size,
            "shared_expert_intermediate_size": spec.shared_expert_intermediate_size,
            "router_aux_loss_coef": 0.001,
        }
    moe = "_moe" if spec.num_experts else ""
    vision = vision_config_json(spec, f"qwen3_5{moe}_vision")
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": f"qwen3_5{moe}",
        "dtype": spec.dtype,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "text_config": text,
        "vision_config": vision,
    }


def random_weights(spec: TinySpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights under the published names. Decays are kept slow (A in 0.01..0.2) so the recurrent
    state carries far along a prompt: a state lost between chunks changes the logits."""
    w = RandomWeights(seed)
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    key_dim = spec.linear_num_key_heads * spec.linear_key_head_dim
    value_dim = spec.linear_num_value_heads * spec.linear_value_head_dim
    conv_dim, hv = 2 * key_dim + value_dim, spec.linear_num_value_heads
    lm = "model.language_model."
    weights: dict[str, torch.Tensor] = {lm + "embed_tokens.weight": w.embedding(VOCAB_SIZE, h)}
    for layer, kind in enumerate(spec.layer_types):
        p = f"{lm}layers.{layer}."
        if kind == "linear_attention":
            a = p + "linear_attn."
            weights |= {
                a + "in_proj_qkv.weight": w.linear(conv_dim, h),
                a + "in_proj_z.weight": w.linear(value_dim, h),
                a + "in_proj_b.weight": w.linear(hv, h),
                a + "in_proj_a.weight": w.linear(hv, h),
                a + "conv1d.weight": w.randn(conv_dim, 1, spec.linear_conv_kernel_dim) * 0.5,
                a + "dt_bias": w.vec(hv, 1.0, 0.1),
                a + "A_log": (0.01 + 0.19 * torch.rand(hv, generator=w.generator)).log(),
                a + "norm.weight": w.vec(spec.linear_value_head_dim, 1.0, 0.1),
                a + "out_proj.weight": w.linear(h, value_dim),
            }
        else:  # per head [query | gate] in q_proj; (1 + weight) norms
            weights |= qwen3_attention_weights(w, p + "self_attn.", h, q, kv, d, norm_mean=0.0, gated=True)
        weights |= decoder_norm_weights(w, p, h, mean=0.0)
        weights |= mlp_weights(w, spec, p + "mlp.")
    weights[lm + "norm.weight"] = w.vec(h, 0.0, 0.1)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = w.embedding(VOCAB_SIZE, h)

    weights |= vision_weights(  # Qwen3-VL's tower without DeepStack
        w,
        width=spec.vision_hidden_size,
        intermediate=spec.vision_intermediate_size,
        depth=spec.vision_depth,
        num_positions=spec.num_position_embeddings,
        out_hidden=h,
        num_deepstack=0,
    )
    # Drawn last, so the rest of the checkpoint is what it was before the head was written.
    weights |= mtp_weights(w, spec)
    return in_dtype(weights, spec.dtype)


def mlp_weights(w: RandomWeights, spec: TinySpec, p: str) -> dict[str, torch.Tensor]:
    """A layer's SwiGLU MLP, or in the MoE model its router, routed experts and shared expert
    (`p` ends in "mlp.")."""
    h = spec.hidden_size
    if not spec.num_experts:
        return swiglu_weights(w, p, h, spec.intermediate_size)
    mi, si = spec.moe_intermediate_size, spec.shared_expert_intermediate_size
    # Expert outputs at half scale: three of them per token (two routed, the shared one) keep the
    # residual stream about the dense model's size.
    weights = {p + "gate.weight": w.linear(spec.num_experts, h)}
    for e in range(spec.num_experts):
        x = f"{p}experts.{e}."
        weights |= {
            x + "gate_proj.weight": w.linear(mi, h),
            x + "up_proj.weight": w.linear(mi, h),
            x + "down_proj.weight": 0.5 * w.linear(h, mi),
        }
    return weights | {
        p + "shared_expert.gate_proj.weight": w.linear(si, h),
        p + "shared_expert.up_proj.weight": w.linear(si, h),
        p + "shared_expert.down_proj.weight": 0.5 * w.linear(h, si),
        p + "shared_expert_gate.weight": w.linear(1, h),
    }


def mtp_weights(w: RandomWeights, spec: TinySpec) -> dict[str, torch.Tensor]:
    """The multi-token-prediction head as published (vlmserve/families/qwen3_5/mtp.py): fc over
    [embedding | hidden], its two input norms, one full-attention layer with the model's MLP (its
    experts in the MoE model), the output norm."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    m = "mtp."
    weights = {
        m + "fc.weight": w.linear(h, 2 * h),
        m + "pre_fc_norm_embedding.weight": w.vec(h, 0.0, 0.1),
        m + "pre_fc_norm_hidden.weight": w.vec(h, 0.0, 0.1),
    }
    weights |= qwen3_attention_weights(w, m + "layers.0.self_attn.", h, q, kv, d, norm_mean=0.0, gated=True)
    weights |= decoder_norm_weights(w, m + "layers.0.", h, mean=0.0)
    weights |= mlp_weights(w, spec, m + "layers.0.mlp.")
    weights[m + "norm.weight"] = w.vec(h, 0.0, 0.1)
    return weights


def write_tiny_qwen3_5(out_dir: str | Path, spec: TinySpec = TinySpec(), *, seed: int = 0, num_shards: int = 1) -> Path:
    """Write the checkpoint into `out_dir` (created; written atomically)."""
    return write_qwen3_vl_files(
        out_dir,
        config_json(spec),
        random_weights(spec, seed),
        tiny_info(spec, seed),
        num_shards,
        chat_template={"chat_template.jinja": QWEN3_5_CHAT_TEMPLATE},
    )
