"""What an engine was built with, said once at start-up: the model and its architecture, the
device (the CPU's name and the features the kernels use, or the GPU's name), dtype,
max_model_len, the KV cache's capacity, the attention backend and linear kernels chosen, and the
memory plan. The server's engine process sends it in its Ready message; the offline LLM logs it."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from vlmserve.engine.config import EngineConfig
from vlmserve.engine.core import EngineCore
from vlmserve.kernels.dispatch import describe_linear_op
from vlmserve.kernels.onednn import PACKED_ROWS, packed_linear
from vlmserve.models.fused_decode import FUSED_ROWS
from vlmserve.models.layers import bound_linear_op
from vlmserve.models.prepack import prepacked_layers

# The x86 features vlmserve's CPU kernels and torch's bf16 paths care about.
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


def describe_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    name, flags = "", set[str]()
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    features = [f for f in CPU_FEATURES if f in flags]
    return f"cpu: {name or 'unknown CPU'} ({' '.join(features) or 'no AVX2'}), {torch.get_num_threads()} threads"


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{device}: {props.name}, {props.total_memory / (1 << 30):.0f} GiB"
    return describe_cpu()


def engine_summary(core: EngineCore, model: str) -> dict[str, str]:
    """The banner's lines, name -> value (plain strings: they cross the process boundary)."""
    info = core.model_info
    plan = core.memory_plan
    decode_kernel = getattr(core.backend, "decode_kernel", None)
    prefill_kernel = getattr(core.backend, "prefill_kernel", None)
    in_process = core.executor.tensor_parallel_size == 1
    graphs = core.runner.decode_graphs if in_process else None
    tp, nnodes = core.config.tensor_parallel_size, core.config.nnodes
    linear = bound_linear_op(core.model) if in_process else None
    packed = prepacked_layers(core.model) if in_process else 0
    decoder = prepacked_layers(core.model, packed_linear) if in_process else 0
    # a decoder that runs a decode step in one kernel call (models/fused_decode.py: the Qwen2 and Qwen3 decoders)
    fused = in_process and any(getattr(m, "fused_decode", None) is not None for m in core.model.modules())
    summary = {
        "model": f"{model} ({info.model_config.architecture}, {info.family.display_name})",
        "device": describe_device(core.device),
        "dtype": str(core.dtype).removeprefix("torch."),
        "max_model_len": str(core.max_model_len),
        "tensor_parallel_size": str(tp) + (f" ({tp // nnodes} ranks on each of {nnodes} nodes)" if nnodes > 1 else ""),
        "KV cache": f"{plan.num_blocks * plan.block_size:,} tokens ({plan.num_blocks:,} blocks of {plan.block_size})",
        "attention": f"{core.backend.name} ({'SDPA' if core.backend.name == 'torch' else 'Triton kernels'})"
        + (f"; decode: CUDA graphs ({len(graphs.buckets)} batch sizes)" if graphs is not None else "")
        + ("; decode: vlmserve CPU kernel (paged, in place)" if decode_kernel is not None else "")
        + ("; prefill and vision: vlmserve AVX-512 BF16 flash kernel" if prefill_kernel is not None else ""),
        "linear layers": "; ".join(
            (["chosen in each rank process"] if not in_process else [])
            + ([describe_linear_op(linear)] if linear is not None else [])
            + (
                [
                    f"decoder: {decoder} layers' weights prepacked for oneDNN (prefill), "
                    f"vlmserve AVX-512 kernel on them up to {PACKED_ROWS} rows"
                ]
                if decoder
                else []
            )
            + ([f"decode and verify steps of up to {FUSED_ROWS} rows: the whole decoder in one call"] if fused else [])
            + ([f"vision tower: oneDNN, {packed} layers' weights prepacked"] if packed else [])
        )
        or "none",
        "memory": plan.describe().removeprefix("memory plan: ") + (" (its smallest rank)" if tp > 1 else ""),
    } | ({"speculative decoding": core.speculative.describe()} if core.speculative is not None else {})
    return summary | _lora_line(core.config)


def _lora_line(config: EngineConfig) -> dict[str, str]:
    if not config.enable_lora:
        return {}
    kept = max(config.max_cpu_loras or config.max_loras, config.max_loras)
    return {
        "LoRA adapters": f"up to {config.max_loras} in a step, rank <= {config.max_lora_rank}, {kept} kept loaded "
        "(language model, vision tower and merger)"
    }


def log_banner(logger: logging.Logger, summary: dict[str, str], title: str, url: str | None = None) -> None:
    """One record per line, names aligned."""
    lines = dict(summary) | ({"serving": url} if url else {})
    width = max(len(name) for name in lines)
    logger.info(title)
    for name, value in lines.items():
        logger.info("  %s  %s", name.ljust(width), value)
