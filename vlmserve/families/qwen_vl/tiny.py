"""Write a tiny random-weight Qwen-VL-Chat checkpoint in its published layout (qwen.tiktoken,
remote-code config.json, safetensors under the published names)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from vlmserve.families.common.tiny import (
    QWEN_VL_BLOCK,
    RandomWeights,
    in_dtype,
    layer_norm_vision_block,
    tiny_info,
    write_checkpoint,
)
from vlmserve.model_files import VOCAB_SIZE, save_weights

# -- Qwen-VL-Chat (first generation) ------------------------------------------------------------

QWEN_VL_IMAGE_START_ID = 151857  # <img>; </img> and <imgpad> follow it


@dataclass(frozen=True)
class QwenVLTinySpec:
    """A tiny Qwen-VL-Chat. hidden_size is the Resampler's width too, which has hidden_size // 128
    heads, so it is at least 128 (256: two heads). seq_length is small so that dynamic NTK and logn
    attention act on test-sized prompts (one image alone is 258 tokens)."""

    hidden_size: int = 256
    intermediate_size: int = 256  # as config.json states it: the MLP is half of it wide
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    seq_length: int = 64
    vision_width: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    vision_mlp_ratio: float = 4.9231  # the published ratio: int(32 * 4.9231) = 157 wide
    image_size: int = 448
    dtype: str = "bfloat16"


# `vlmserve make-tiny --arch qwen_vl` writes the one preset (its lm_head is always untied).
PRESETS = {("qwen_vl", "tiny"): QwenVLTinySpec()}


def qwen_vl_config(
    *,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    seq_length: int,
    visual: dict[str, object],
    dtype: str = "bfloat16",
) -> dict[str, object]:
    """config.json in Qwen-VL-Chat's published layout (its remote code's QWenConfig)."""
    return {
        "architectures": ["QWenLMHeadModel"],
        "attn_dropout_prob": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_qwen.QWenConfig",
            "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel",
        },
        "bf16": False,
        "emb_dropout_prob": 0.0,
        "fp16": False,
        "fp32": False,
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "kv_channels": hidden_size // num_attention_heads,
        "layer_norm_epsilon": 1e-06,
        "max_position_embeddings": 8192,
        "model_type": "qwen",
        "no_bias": True,
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "onnx_safe": None,
        "rotary_emb_base": 10000,
        "rotary_pct": 1.0,
        "scale_attn_weights": True,
        "seq_length": seq_length,
        "tie_word_embeddings": False,
        "tokenizer_type": "QWenTokenizer",
        "torch_dtype": dtype,
        "transformers_version": "4.31.0",
        "use_cache": True,
        "use_dynamic_ntk": True,
        "use_flash_attn": "auto",
        "use_logn_attn": True,
        "visual": visual,
        "vocab_size": VOCAB_SIZE,
    }


# Qwen-VL-Chat's generation_config.json; chat() adds the stop words <|im_end|> and <|im_start|>.
QWEN_VL_GENERATION_CONFIG = {
    "chat_format": "chatml",
    "do_sample": True,
    "eos_token_id": 151643,
    "max_new_tokens": 512,
    "max_window_size": 6144,
    "pad_token_id": 151643,
    "top_k": 0,
    "top_p": 0.3,
    "transformers_version": "4.31.0",
}

QWEN_VL_TOKENIZER_CONFIG = {
    "model_max_length": 8192,
    "tokenizer_class": "QWenTokenizer",
    "auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]},
}


def _qwen_vl_spec_config(spec: QwenVLTinySpec) -> dict[str, object]:
    visual: dict[str, object] = {
        "heads": spec.vision_heads,
        "image_size": spec.image_size,
        "image_start_id": QWEN_VL_IMAGE_START_ID,
        "layers": spec.vision_layers,
        "mlp_ratio": spec.vision_mlp_ratio,
        "output_dim": spec.hidden_size,
        "patch_size": 14,
        "width": spec.vision_width,
    }
    return qwen_vl_config(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        seq_length=spec.seq_length,
        visual=visual,
        dtype=spec.dtype,
    )


def qwen_vl_random_weights(spec: QwenVLTinySpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights under the published Qwen-VL-Chat names; scales keep activations near unit size."""
    from vlmserve.families.qwen_vl.visual import sincos_pos_embed_2d

    w = RandomWeights(seed)
    h, mlp = spec.hidden_size, spec.intermediate_size // 2
    weights: dict[str, torch.Tensor] = {"transformer.wte.weight": w.embedding(VOCAB_SIZE, h)}
    for layer in range(spec.num_hidden_layers):
        p = f"transformer.h.{layer}."
        weights |= {
            p + "ln_1.weight": w.vec(h, 1.0, 0.1),
            p + "attn.c_attn.weight": w.linear(3 * h, h),
            p + "attn.c_attn.bias": w.vec(3 * h, std=0.1),
            p + "attn.c_proj.weight": w.linear(h, h),
            p + "ln_2.weight": w.vec(h, 1.0, 0.1),
            p + "mlp.w1.weight": w.linear(mlp, h),
            p + "mlp.w2.weight": w.linear(mlp, h),
            p + "mlp.c_proj.weight": w.linear(h, mlp),
        }
    weights["transformer.ln_f.weight"] = w.vec(h, 1.0, 0.1)
    weights["lm_head.weight"] = w.embedding(VOCAB_SIZE, h)

    e, v_mlp = spec.vision_width, int(spec.vision_width * spec.vision_mlp_ratio)
    v = "transformer.visual."
    weights |= {
        v + "conv1.weight": w.randn(e, 3, 14, 14) / (3 * 14 * 14) ** 0.5,
        v + "positional_embedding": w.randn(256, e),
        v + "ln_pre.weight": w.vec(e, 1.0, 0.1),
        v + "ln_pre.bias": w.vec(e),
    }
    for block in range(spec.vision_layers):
        weights |= layer_norm_vision_block(w, f"{v}transformer.resblocks.{block}.", e, v_mlp, QWEN_VL_BLOCK)
    a = v + "attn_pool."
    weights |= {
        a + "query": w.randn(256, h),
        a + "pos_embed": sincos_pos_embed_2d(h, 16),  # fixed, as the reference initialises it
        a + "kv_proj.weight": w.linear(h, e),
        a + "attn.in_proj_weight": w.linear(3 * h, h),
        a + "attn.in_proj_bias": w.vec(3 * h, std=0.1),
        a + "attn.out_proj.weight": w.linear(h, h),
        a + "attn.out_proj.bias": w.vec(h),
        a + "ln_q.weight": w.vec(h, 1.0, 0.1),
        a + "ln_q.bias": w.vec(h),
        a + "ln_kv.weight": w.vec(h, 1.0, 0.1),
        a + "ln_kv.bias": w.vec(h),
        v + "ln_post.weight": w.vec(h, 1.0, 0.1),
        v + "ln_post.bias": w.vec(h),
        v + "proj": w.linear(h, h),
    }
    return in_dtype(weights, spec.dtype)


def write_tiny_qwen_vl(
    out_dir: str | Path, spec: QwenVLTinySpec = QwenVLTinySpec(), *, seed: int = 0, num_shards: int = 1
) -> Path:
    """Write a tiny random Qwen-VL-Chat checkpoint in the published layout into `out_dir`
    (created; written atomically): config.json with auto_map, generation_config.json,
    tokenizer_config.json, qwen.tiktoken and safetensors weights under the published names.
    (The published repository ships its weights as pytorch_model-*.bin and the remote code's
    *.py files; neither is written.)"""
    from vlmserve.tools.tiktoken_to_hf import qwen_tiktoken_path

    files: dict[str, object] = {
        "config.json": _qwen_vl_spec_config(spec),
        "generation_config.json": QWEN_VL_GENERATION_CONFIG,
        "tokenizer_config.json": QWEN_VL_TOKENIZER_CONFIG,
        "vlmserve_tiny.json": tiny_info(spec, seed),
    }

    def write_rest(folder: Path) -> None:
        shutil.copyfile(qwen_tiktoken_path(), folder / "qwen.tiktoken")
        save_weights(qwen_vl_random_weights(spec, seed), folder, num_shards)

    return write_checkpoint(out_dir, files, write_rest)
