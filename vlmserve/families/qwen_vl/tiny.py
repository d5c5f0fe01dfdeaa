"""Write a tiny random-weight Qwen-VL-Chat checkpoint in its published layout (qwen.tiktoken,
remote-code config.json, safetensors under the published names)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

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

    g = torch.Generator().manual_seed(seed)

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / in_f**0.5

    def vec(n: int, mean: float = 0.0, std: float = 0.02) -> torch.Tensor:
        return mean + std * torch.randn(n, generator=g)

    h, mlp = spec.hidden_size, spec.intermediate_size // 2
    w: dict[str, torch.Tensor] = {"transformer.wte.weight": 0.3 * torch.randn(VOCAB_SIZE, h, generator=g)}
    for layer in range(spec.num_hidden_layers):
        p = f"transformer.h.{layer}."
        w |= {
            p + "ln_1.weight": vec(h, 1.0, 0.1),
            p + "attn.c_attn.weight": linear(3 * h, h),
            p + "attn.c_attn.bias": vec(3 * h, std=0.1),
            p + "attn.c_proj.weight": linear(h, h),
            p + "ln_2.weight": vec(h, 1.0, 0.1),
            p + "mlp.w1.weight": linear(mlp, h),
            p + "mlp.w2.weight": linear(mlp, h),
            p + "mlp.c_proj.weight": linear(h, mlp),
        }
    w["transformer.ln_f.weight"] = vec(h, 1.0, 0.1)
    w["lm_head.weight"] = 0.3 * torch.randn(VOCAB_SIZE, h, generator=g)

    e, v_mlp = spec.vision_width, int(spec.vision_width * spec.vision_mlp_ratio)
    v = "transformer.visual."
    w |= {
        v + "conv1.weight": torch.randn(e, 3, 14, 14, generator=g) / (3 * 14 * 14) ** 0.5,
        v + "positional_embedding": torch.randn(256, e, generator=g),
        v + "ln_pre.weight": vec(e, 1.0, 0.1),
        v + "ln_pre.bias": vec(e),
    }
    for block in range(spec.vision_layers):
        p = f"{v}transformer.resblocks.{block}."
        w |= {
            p + "ln_1.weight": vec(e, 1.0, 0.1),
            p + "ln_1.bias": vec(e),
            p + "ln_2.weight": vec(e, 1.0, 0.1),
            p + "ln_2.bias": vec(e),
            p + "attn.in_proj.weight": linear(3 * e, e),
            p + "attn.in_proj.bias": vec(3 * e, std=0.1),
            p + "attn.out_proj.weight": linear(e, e),
            p + "attn.out_proj.bias": vec(e),
            p + "mlp.c_fc.weight": linear(v_mlp, e),
            p + "mlp.c_fc.bias": vec(v_mlp),
            p + "mlp.c_proj.weight": linear(e, v_mlp),
            p + "mlp.c_proj.bias": vec(e),
        }
    a = v + "attn_pool."
    w |= {
        a + "query": torch.randn(256, h, generator=g),
        a + "pos_embed": sincos_pos_embed_2d(h, 16),  # fixed, as the reference initialises it
        a + "kv_proj.weight": linear(h, e),
        a + "attn.in_proj_weight": linear(3 * h, h),
        a + "attn.in_proj_bias": vec(3 * h, std=0.1),
        a + "attn.out_proj.weight": linear(h, h),
        a + "attn.out_proj.bias": vec(h),
        a + "ln_q.weight": vec(h, 1.0, 0.1),
        a + "ln_q.bias": vec(h),
        a + "ln_kv.weight": vec(h, 1.0, 0.1),
        a + "ln_kv.bias": vec(h),
        v + "ln_post.weight": vec(h, 1.0, 0.1),
        v + "ln_post.bias": vec(h),
        v + "proj": linear(h, h),
    }
    dtype = getattr(torch, spec.dtype)
    return {name: t.to(dtype).contiguous() for name, t in w.items()}


def write_tiny_qwen_vl(
    out_dir: str | Path, spec: QwenVLTinySpec = QwenVLTinySpec(), *, seed: int = 0, num_shards: int = 1
) -> Path:
    """Write a tiny random Qwen-VL-Chat checkpoint in the published layout into `out_dir`
    (created; written atomically): config.json with auto_map, generation_config.json,
    tokenizer_config.json, qwen.tiktoken and safetensors weights under the published names.
    (The published repository ships its weights as pytorch_model-*.bin and the remote code's
    *.py files; neither is written.)"""
    from vlmserve.tools.tiktoken_to_hf import qwen_tiktoken_path

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        files = {
            "config.json": _qwen_vl_spec_config(spec),
            "generation_config.json": QWEN_VL_GENERATION_CONFIG,
            "tokenizer_config.json": QWEN_VL_TOKENIZER_CONFIG,
        }
        for name, content in files.items():
            (tmp / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        shutil.copyfile(qwen_tiktoken_path(), tmp / "qwen.tiktoken")
        save_weights(qwen_vl_random_weights(spec, seed), tmp, num_shards)
        (tmp / "vlmserve_tiny.json").write_text(json.dumps({"spec": asdict(spec), "seed": seed}) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
