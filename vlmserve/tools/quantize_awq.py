"""Write a float checkpoint's decoder linear layers as a 4-bit AWQ checkpoint (AutoAWQ's GEMM layout,
asymmetric, one scale and zero point per output and group of inputs), by round-to-nearest: the
layout vlmserve loads and the kernels run, for measuring them (`vlmserve bench` on the 2B
architecture) and for the accuracy tests. Not AWQ's activation-aware search: real AWQ checkpoints
choose their scales from calibration data, so their accuracy is better than this one's.

    python -m vlmserve.tools.quantize_awq SRC DST [--group-size 128]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch

from vlmserve.model_files import iterate_weights, safetensors_files, save_weights
from vlmserve.models.quant.packed import AWQ_ORDER, PACK

# The decoder's linear layers (transformers 4.x and 5 names); the vision tower and lm_head stay float.
DECODER_LINEAR = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def quantize_rtn(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [K, N] ints 0..15, zeros [K / group, N] ints 0..15, scales [K / group, N]
    fp16): per output and group, scale = (max - min) / 15 and zero = round(-min / scale), so that
    (q - zero) * scale spans the group's range."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=1e-8).half()
    s = scales.float()
    zeros = torch.round(-low / s).clamp(0, 15)
    q = torch.round(w / s[..., None] + zeros[..., None]).clamp(0, 15)
    return q.reshape(n, k).t().to(torch.int32), zeros.t().to(torch.int32), scales.t().contiguous()


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, C] ints 0..15 -> [R, C / 8] int32 in AutoAWQ's interleaved order (nibble i holds column
    8 j + AWQ_ORDER[i])."""
    r, c = values.shape
    v = values.reshape(r, c // PACK, PACK)[..., list(AWQ_ORDER)]
    shifts = torch.arange(0, 32, 32 // PACK, dtype=torch.int32)
    return (v << shifts).sum(-1, dtype=torch.int32)


def quantize_checkpoint(src: Path, dst: Path, group: int = 128) -> Path:
    """DST: SRC's files with its decoder linear layers in AWQ's layout and config.json's
    quantization_config saying so."""
    dst.mkdir(parents=True, exist_ok=True)
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in iterate_weights(src):
        if DECODER_LINEAR.search(name) and tensor.shape[1] % group == 0:
            q, zeros, scales = quantize_rtn(tensor, group)
            module = name.removesuffix(".weight")
            weights[f"{module}.qweight"] = pack_awq(q)
            weights[f"{module}.qzeros"] = pack_awq(zeros)
            weights[f"{module}.scales"] = scales
        else:
            weights[name] = tensor
    skip = {f.name for f in safetensors_files(src)} | {"model.safetensors.index.json", "config.json"}
    for f in src.iterdir():
        if f.is_file() and f.name not in skip:
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "version": "gemm",
        "zero_point": True,
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_weights(weights, dst, max(1, len(safetensors_files(src))))
    return dst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args(argv)
    print(quantize_checkpoint(args.src, args.dst, args.group_size))


if __name__ == "__main__":
    main()
