"""The same workload through transformers' generate: static batches of `batch_size` requests,
left-padded, each batch running to its longest request (only each request's own tokens count
as useful). Inputs are the token ids and pixel patches vlmserve's processor made, which the
test suite shows equal transformers' own processor outputs, so both engines see the same work.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import torch

from vlmserve.bench.metrics import RequestTiming, RunResult
from vlmserve.bench.sampling import hf_generate_kwargs
from vlmserve.bench.workload import BenchRequest
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.progress import progress
from vlmserve.registry import FAMILIES, family_of, load_model_config

logger = logging.getLogger(__name__)

PAD_ID = 151643
IMAGE_TOKEN_ID = 151655


def load_hf_model(model_dir: Path, dtype: torch.dtype) -> Any:
    """transformers' model for the checkpoint's family (Qwen2-VL or Qwen2.5-VL)."""
    try:
        import transformers
    except ImportError:
        raise SystemExit("the transformers comparison needs transformers: pip install -e '.[bench]'") from None
    family = family_of(load_model_config(model_dir / "config.json"))
    if family.transformers_class is None:
        runs = " and ".join(f.display_name for f in FAMILIES if f.transformers_class)
        raise SystemExit(f"the transformers comparison runs {runs} checkpoints, not {family.display_name}")
    return getattr(transformers, family.transformers_class).from_pretrained(str(model_dir), dtype=dtype).eval()


class _FirstLogits:
    """A logits processor that notes when the first token's logits exist (prefill done)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.at is None:
            if scores.is_cuda:  # the call comes when the prefill is queued, not when it is done
                torch.cuda.synchronize(scores.device)
            self.at = time.perf_counter()
        return scores


def _batch_inputs(batch: list[BenchRequest]) -> dict[str, torch.Tensor]:
    longest = max(r.prompt.num_tokens for r in batch)
    ids = torch.full((len(batch), longest), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(batch):
        n = r.prompt.num_tokens
        ids[row, longest - n :] = torch.tensor(r.prompt.prompt_token_ids)
        mask[row, longest - n :] = 1
    items = [item for r in batch for item in r.prompt.mm_items]
    inputs = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == IMAGE_TOKEN_ID).int()}
    if items:
        inputs["pixel_values"] = torch.cat([item.pixel_values for item in items])
        inputs["image_grid_thw"] = torch.tensor([item.grid_thw for item in items])
    return inputs


@torch.inference_mode()
def generate_batch(
    model: Any, batch: list[BenchRequest], max_new_tokens: int, sampling: dict[str, Any] | None = None
) -> tuple[float, float, float, list[list[int]]]:
    """(start, first logits, end, each row's max_new_tokens new tokens) of one generate call,
    sampling as `sampling` (SamplingParams fields; default greedy), never stopping early."""
    from transformers import LogitsProcessorList

    clock = _FirstLogits()
    inputs = _batch_inputs(batch)
    start = time.perf_counter()
    # On a GPU the pixels' and ids' upload is part of the time to first token (as in vlmserve's steps).
    inputs = {name: t.to(model.device) for name, t in inputs.items()}
    sequences = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        # Run past eos without keeping it from being chosen, as vlmserve's ignore_eos (and
        # vLLM's) does; min_new_tokens would mask eos and change the greedy tokens.
        eos_token_id=None,
        pad_token_id=PAD_ID,
        **hf_generate_kwargs({"temperature": 0.0} if sampling is None else sampling),
        logits_processor=LogitsProcessorList([clock]),
    )
    if sequences.is_cuda:
        torch.cuda.synchronize(sequences.device)
    end = time.perf_counter()
    new_tokens = sequences[:, inputs["input_ids"].shape[1] :].tolist()
    assert all(len(row) == max_new_tokens for row in new_tokens)
    return start, clock.at or end, end, new_tokens


def run_hf(
    model: Any,
    requests: list[BenchRequest],
    batch_size: int,
    desc: str | None = None,
    sampling: dict[str, Any] | None = None,
) -> RunResult:
    """`desc`: show progress (output tokens, batch by batch, with an estimate of the time left).
    `sampling`: SamplingParams fields, sampled the same way through generate (default greedy)."""
    timings = []
    total = sum(r.output_len for r in requests)
    tokens = progress(desc=desc, total=total, unit="token", logger=logger) if desc else None
    begin = time.perf_counter()  # every request arrives now; a static batch waits for the one before
    with tokens or contextlib.nullcontext():
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            batch_len = max(r.output_len for r in batch)
            _, first, end, new_tokens = generate_batch(model, batch, batch_len, sampling)
            per_token = (end - first) / max(batch_len - 1, 1)
            for r, row in zip(batch, new_tokens, strict=True):
                # A request's own tokens arrive at the batch's pace; it is done at its own length.
                own_end = first + per_token * (r.output_len - 1)
                own = row[: r.output_len]
                timings.append(RequestTiming(r.index, r.prompt.num_tokens, len(own), begin, first, own_end, own))
            if tokens is not None:
                tokens.update(sum(r.output_len for r in batch))
    wall = time.perf_counter() - begin
    return RunResult("transformers", {"batch_size": batch_size}, wall, timings)


def _short_text_requests(count: int, num_tokens: int) -> list[BenchRequest]:
    g = torch.Generator().manual_seed(count)
    return [
        BenchRequest(
            i, ProcessedPrompt(torch.randint(0, 150000, (num_tokens,), generator=g).tolist(), [], None, 0), 1, (0, 0)
        )
        for i in range(count)
    ]


def probe_batch_sizes(
    model: Any, requests: list[BenchRequest], candidates: list[int], probe_steps: int = 4
) -> tuple[int, dict[int, dict[str, float]]]:
    """Pick transformers' best batch size for this workload without running it at every size.

    Prefill cost is measured once, on one real request: it grows with the tokens prefilled. The
    decode step time at each batch size is measured on short text prompts (attention over a few
    hundred keys is a small part of a step). The workload's time at a size is then predicted as
    the sum over its batches of their prefill + (longest output - 1) x step, and the size with the
    most useful tokens per second wins. The chosen size then runs the workload for real."""
    start, first, _, _ = generate_batch(model, requests[:1], 2)
    prefill_per_request = first - start
    useful = sum(r.output_len for r in requests)
    probes: dict[int, dict[str, float]] = {}
    sizes = [size for size in candidates if size <= len(requests)]
    for size in progress(sizes, desc="transformers: probing batch sizes", unit="size", logger=logger):
        _, first, end, _ = generate_batch(model, _short_text_requests(size, 16), probe_steps)
        step = (end - first) / (probe_steps - 1)
        predicted = 0.0
        for i in range(0, len(requests), size):
            batch = requests[i : i + size]
            predicted += prefill_per_request * len(batch) + (max(r.output_len for r in batch) - 1) * step
        probes[size] = {"step_s": step, "predicted_tokens_per_s": useful / predicted}
    best = max(probes, key=lambda s: probes[s]["predicted_tokens_per_s"])
    for probe in probes.values():
        probe["prefill_per_request_s"] = prefill_per_request
    return best, probes
