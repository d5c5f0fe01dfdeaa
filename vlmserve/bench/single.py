"""`vlmserve bench --single`: one request alone, vlmserve against transformers in alternating
rounds, with the memory-bandwidth limit of a decode step measured in the same rounds.

A decode step of one request reads every weight of the language model once (and the request's
KV cache); it cannot run faster than those bytes over the machine's read bandwidth. Each round
measures that bandwidth (a large float32 sum: torch reads it at the machine's rate) right before
vlmserve's run, so the percentage of the limit compares like with like on a machine whose
bandwidth drifts from minute to minute.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

from vlmserve.bench.metrics import RunResult, print_table
from vlmserve.bench.run_hf import run_hf
from vlmserve.bench.run_vlmserve import run_vlmserve
from vlmserve.bench.workload import BenchRequest
from vlmserve.entrypoints.llm import LLM
from vlmserve.kernels.onednn import weight_address, weight_nbytes

READ_BYTES = 1 << 30  # the buffer the bandwidth is measured on: far past every cache


def read_bandwidth_gbs(buffer: torch.Tensor, repeat: int = 5) -> float:
    """The best of `repeat` full reads of `buffer`, in GB/s (its sum reads each byte once)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / best / 1e9


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights one decode step reads: every parameter and buffer of the language
    model (int8 or packed int4 where quantized, with their scales) and lm_head, but neither the
    vision tower nor the embedding table (a step reads one row of it), a tied lm_head once."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        address = weight_address(t) if t.is_mkldnn else t.data_ptr()  # reordered for oneDNN: its memory
        if address not in seen:
            seen.add(address)
            total += weight_nbytes(t) if t.is_mkldnn else t.numel() * t.element_size()

    head = getattr(model, "lm_head", None)
    if head is not None:
        for t in [*head.parameters(), *head.buffers()]:
            add(t)
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in tensors:
        if "visual" in name.split(".") or "embed_tokens" in name or t.device.type == "meta":
            continue
        add(t)
    return total


def kv_bytes_per_token(llm: LLM, dtype: torch.dtype) -> int:
    """KV cache bytes one token of context adds over all layers (what a decode step reads per
    token of its context)."""
    text = llm.llm_engine.model_config.text
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * itemsize


def run_single(args: argparse.Namespace, llm: LLM, hf_model: Any, request: list[BenchRequest]) -> dict[str, Any]:
    """Alternating rounds of (bandwidth, vlmserve, transformers); prints the table and returns
    the report's part."""
    engine = llm.llm_engine
    weights = decode_weight_bytes(engine.model)
    (req,) = request
    # Mean context over the decode steps: prompt plus half the output.
    kv = kv_bytes_per_token(llm, getattr(torch, args.dtype)) * (req.prompt.num_tokens + req.output_len // 2)
    step_bytes = weights + kv
    buffer = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    rounds: list[dict[str, Any]] = []
    ours: list[RunResult] = []
    theirs: list[RunResult] = []
    for r in range(args.single_rounds):
        bandwidth = read_bandwidth_gbs(buffer)
        engine.reset_prefix_cache()
        name = f"round {r + 1} of {args.single_rounds}"
        mine = run_vlmserve(
            engine, request, 1, tag=f"-single{r}", desc=f"vlmserve, {name}", sampling=args.sampling_fields
        )
        ours.append(mine)
        limit = step_bytes / (bandwidth * 1e9)
        row: dict[str, Any] = {
            "round": r + 1,
            "read_GBps": round(bandwidth, 1),
            "limit_ms": round(limit * 1e3, 1),
            "vlmserve_step_ms": round(mine.tpot_mean * 1e3, 1),
            "of_limit_%": round(100 * limit / mine.tpot_mean, 1),
            "vlmserve_ttft_s": round(mine.ttft_mean, 3),
        }
        if hf_model is not None:
            hf = run_hf(hf_model, request, 1, desc=f"transformers, {name}", sampling=args.sampling_fields)
            theirs.append(hf)
            row |= {
                "transformers_step_ms": round(hf.tpot_mean * 1e3, 1),
                "transformers_ttft_s": round(hf.ttft_mean, 3),
                "decode_x": round(hf.tpot_mean / mine.tpot_mean, 2),
                "ttft_x": round(hf.ttft_mean / mine.ttft_mean, 2),
            }
        rounds.append(row)
    del buffer

    print(
        f"\none request alone: {req.prompt.num_tokens} prompt tokens "
        f"({req.prompt.mm_items[0].length if req.prompt.mm_items else 0} of them image), "
        f"{req.output_len} output tokens, vlmserve {args.quantization or args.dtype}"
        + ("" if hf_model is None else f", transformers {args.dtype}")
    )
    columns = list(rounds[0])
    print_table(
        f"a decode step reads {weights / 1e9:.3f} GB of weights + {kv / 1e6:.1f} MB of KV cache; "
        "limit = those bytes / the read bandwidth measured before the round",
        rounds,
        columns,
    )
    medians = {k: statistics.median(row[k] for row in rounds) for k in columns if k != "round"}
    print("median  " + "  ".join(f"{k} {v:g}" for k, v in medians.items()))
    return {
        "weight_bytes_per_step": weights,
        "kv_bytes_per_step": kv,
        "rounds": rounds,
        "medians": medians,
        "vlmserve": [x.to_json() for x in ours],
        "transformers": [x.to_json() for x in theirs],
    }
