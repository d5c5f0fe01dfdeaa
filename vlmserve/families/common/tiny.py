"""What every family's tiny-checkpoint writer (its tiny.py) does the same way: random weights at
scales that keep activations near unit size, so that every part visibly moves the output; the
LayerNorm vision blocks of Qwen2-VL and Qwen3-VL under their published names; the added tokens
of a Qwen tokenizer_config.json; and the folder written atomically. Real weights cannot be
downloaded where vlmserve is developed and tested, so tests and the demo run on these."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch


class RandomWeights:
    """Draws from one seeded generator, in call order (a writer's order of calls fixes its weights)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator)

    def linear(self, out_features: int, in_features: int) -> torch.Tensor:
        """A Linear's weight [out, in] of unit-variance outputs for unit-variance inputs."""
        return self.randn(out_features, in_features) / in_features**0.5

    def vec(self, n: int, mean: float = 0.0, std: float = 0.02) -> torch.Tensor:
        """A bias (mean 0) or a norm's scale (mean 1, or 0 for the (1 + weight) norms)."""
        return mean + std * self.randn(n)

    def embedding(self, rows: int, width: int) -> torch.Tensor:
        return 0.3 * self.randn(rows, width)


def in_dtype(weights: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """The tensors in the checkpoint's dtype ("bfloat16", ...), contiguous for safetensors."""
    return {name: t.to(getattr(torch, dtype)).contiguous() for name, t in weights.items()}


def qwen3_attention_weights(
    w: RandomWeights, prefix: str, hidden: int, q: int, kv: int, head_dim: int, norm_mean: float, gated: bool = False
) -> dict[str, torch.Tensor]:
    """A Qwen3 attention (`prefix` ends in "self_attn."): q/k/v/o projections without biases, q
    of `q` rows (twice that when `gated`: Qwen3.5's per-head [query | gate]), and the per-head
    q/k norms' scales around norm_mean (1, or 0 for Qwen3.5's (1 + weight) norms)."""
    return {
        prefix + "q_proj.weight": w.linear(2 * q if gated else q, hidden),
        prefix + "k_proj.weight": w.linear(kv, hidden),
        prefix + "v_proj.weight": w.linear(kv, hidden),
        prefix + "o_proj.weight": w.linear(hidden, q),
        prefix + "q_norm.weight": w.vec(head_dim, norm_mean, 0.1),
        prefix + "k_norm.weight": w.vec(head_dim, norm_mean, 0.1),
    }


def decoder_norm_weights(w: RandomWeights, prefix: str, hidden: int, mean: float) -> dict[str, torch.Tensor]:
    """A decoder layer's two RMSNorm scales (around `mean`: 1, or 0 for the (1 + weight) norms)."""
    return {
        prefix + "input_layernorm.weight": w.vec(hidden, mean, 0.1),
        prefix + "post_attention_layernorm.weight": w.vec(hidden, mean, 0.1),
    }


def swiglu_weights(w: RandomWeights, prefix: str, hidden: int, intermediate: int) -> dict[str, torch.Tensor]:
    """A SwiGLU MLP's gate, up and down projections (`prefix` ends in "mlp." or "shared_expert.")."""
    return {
        prefix + "gate_proj.weight": w.linear(intermediate, hidden),
        prefix + "up_proj.weight": w.linear(intermediate, hidden),
        prefix + "down_proj.weight": w.linear(hidden, intermediate),
    }


# A LayerNorm vision block's module names in a checkpoint: two norms, the fused qkv and the
# output projection, the MLP's two layers.
QWEN2_VL_BLOCK = ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
QWEN3_VL_BLOCK = ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")
QWEN_VL_BLOCK = ("ln_1", "ln_2", "attn.in_proj", "attn.out_proj", "mlp.c_fc", "mlp.c_proj")


def layer_norm_vision_block(
    w: RandomWeights, prefix: str, width: int, mlp_width: int, names: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    """One vision block of LayerNorms, a fused qkv, an output projection and a two-layer MLP, all
    with biases, under `names` (QWEN2_VL_BLOCK, QWEN3_VL_BLOCK, QWEN_VL_BLOCK)."""
    norm1, norm2, qkv, proj, fc1, fc2 = (prefix + name for name in names)
    return {
        norm1 + ".weight": w.vec(width, 1.0, 0.1),
        norm1 + ".bias": w.vec(width),
        norm2 + ".weight": w.vec(width, 1.0, 0.1),
        norm2 + ".bias": w.vec(width),
        qkv + ".weight": w.linear(3 * width, width),
        qkv + ".bias": w.vec(3 * width, std=0.1),
        proj + ".weight": w.linear(width, width),
        proj + ".bias": w.vec(width),
        fc1 + ".weight": w.linear(mlp_width, width),
        fc1 + ".bias": w.vec(mlp_width),
        fc2 + ".weight": w.linear(width, mlp_width),
        fc2 + ".bias": w.vec(width),
    }


def added_tokens_decoder(first_id: int, tokens: Sequence[tuple[str, bool]]) -> dict[str, dict[str, object]]:
    """tokenizer_config.json's added_tokens_decoder: (content, special) pairs, ids from first_id on."""
    return {
        str(first_id + k): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for k, (content, special) in enumerate(tokens)
    }


def tiny_info(spec: Any, seed: int) -> dict[str, object]:
    """vlmserve_tiny.json: the spec (a dataclass) and seed a checkpoint was drawn from."""
    return {"spec": asdict(spec), "seed": seed}


def write_checkpoint(out_dir: str | Path, files: dict[str, object], write_rest: Callable[[Path], None]) -> Path:
    """Write a checkpoint folder into `out_dir` (created; written atomically: in a temporary
    folder beside it, then renamed, so a reader never sees half of one): `files` by name (a str
    as it is, anything else as indented JSON), then what write_rest writes into the folder
    (tokenizer files, weights). A name may hold folders ("1_Pooling/config.json")."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        for name, content in files.items():
            text = content if isinstance(content, str) else json.dumps(content, indent=2, ensure_ascii=False) + "\n"
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)  # "1_Pooling/config.json"
            (tmp / name).write_text(text, encoding="utf-8")
        write_rest(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
