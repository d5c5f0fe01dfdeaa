"""Where the time of one request goes, measured: `python -m vlmserve.bench.breakdown [MODEL]`.

Decode step (one request, a few hundred tokens of context; where the decoder runs a decode step in
one call, models/fused_decode.py, the parts come from steps run layer by layer, in rounds alternating
with fused ones):
  - the matrix-vector products (every Linear of the language model and lm_head), timed one by
    one on their own, with the bytes they stream and the bandwidth that makes;
  - the model's forward pass as a whole (so norms, rotary, attention are forward - matmuls);
  - the engine step (so scheduling, batch building, sampling, detokenizing are step - forward);
  - transformers: its generate's time per token against its forward pass alone.
Prefill of one 448x448 image and its prompt: vision encoder and language model, with the
arithmetic rate they reach, for both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vlmserve.bench.metrics import median_seconds
from vlmserve.bench.run_hf import load_hf_model
from vlmserve.bench.workload import make_workload
from vlmserve.entrypoints.llm import LLM
from vlmserve.models.layers import Linear
from vlmserve.sampling_params import SamplingParams


class _Timers:
    """Accumulates wall time spent inside wrapped callables, during real engine steps."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


@torch.inference_mode()
def decode_breakdown(llm: LLM, context: int, hf: Any, steps: int = 48, rounds: int = 3) -> dict[str, float]:
    """Parts of real decode steps of one request, timed inside the same steps (so the shares
    add up whatever the machine is doing), and transformers' step and forward in alternating
    rounds (medians)."""
    engine = llm.llm_engine
    model, runner = engine.model, engine.runner
    # A decoder that runs a decode step in one call (FusedDecode) has no parts to time: the
    # parts come from steps run layer by layer, and the fused step from rounds alternating with them.
    fused: list[tuple[Any, Any]] = [(m, getattr(m, "fused_decode", None)) for m in model.modules()]
    fused = [(m, call) for m, call in fused if call is not None]

    def use_fused(on: bool) -> None:
        for module, call in fused:
            module.fused_decode = call if on else None

    ids = torch.randint(0, 150000, (context,)).tolist()
    params = SamplingParams(temperature=0, max_tokens=rounds * steps * (2 if fused else 1) + 8, ignore_eos=True)
    engine.add_request("bd", engine.processor.process(ids, []), params)
    engine.step()  # prefill
    engine.step()  # the first decode step: a fused decoder takes its weights' addresses, before the timers wrap them
    timers = _Timers()
    for name, module in model.named_modules():
        if isinstance(module, Linear) and not name.startswith("visual"):
            module.op = timers.wrap("lm_head" if name == "lm_head" else "layer_matmuls", module.op)
    model.forward = timers.wrap("forward", model.forward)  # type: ignore[method-assign]
    runner.sampler = timers.wrap("sampling", runner.sampler)  # type: ignore[assignment]
    for module in model.modules():
        backend = getattr(module, "backend", None)
        if backend is not None and getattr(backend, "decode_kernel", None) is not None:
            backend.decode_kernel = timers.wrap("decode_attention", backend.decode_kernel)
            break  # one backend object is shared by every layer

    ours: list[tuple[float, dict[str, float]]] = []  # (step, its parts) by round
    hf_steps: list[float] = []
    hf_forwards: list[float] = []
    fused_steps: list[float] = []
    for _ in range(rounds):
        use_fused(False)
        timers.seconds.clear()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        ours.append(((time.perf_counter() - start) / steps, {k: v / steps for k, v in timers.seconds.items()}))
        if fused:
            use_fused(True)
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            fused_steps.append((time.perf_counter() - start) / steps)
        if hf is not None:
            hf_steps.append(_hf_step(hf, ids, 16))
            hf_forwards.append(_hf_forward(hf, ids))
    engine.abort_request("bd")
    use_fused(True)

    # The median round, with the parts timed inside its own steps (another round's parts need not
    # add up to this one's step on a noisy machine).
    step, parts = sorted(ours, key=lambda r: r[0])[len(ours) // 2]
    sizes = {n: m.weight.numel() * m.weight.element_size() for n, m in model.named_modules() if isinstance(m, Linear)}
    head_bytes = sizes["lm_head"]
    layer_bytes = sum(b for n, b in sizes.items() if not n.startswith("visual") and n != "lm_head")
    matmuls = parts["layer_matmuls"]
    attention = parts.get("decode_attention", 0.0)
    out = {
        **({"vlmserve_step, the decoder in one fused call_s": statistics.median(fused_steps)} if fused else {}),
        "vlmserve_step" + (", layer by layer" if fused else "") + "_s": step,
        "  layer matmuls_s": matmuls,
        "  lm_head_s": parts["lm_head"],
        "  decode attention_s": parts.get("decode_attention", 0.0),
        "  rest of the forward (norms, rotary, embeddings)_s": parts["forward"] - matmuls - attention,
        "  sampling_s": parts["sampling"],
        "  engine (scheduling, batch, detokenizing)_s": step - parts["forward"] - parts["lm_head"] - parts["sampling"],
        "weights streamed per step_GB": (layer_bytes + head_bytes) / 1e9,
        "matmul read rate_GBps": (layer_bytes + head_bytes) / (matmuls + parts["lm_head"]) / 1e9,
    }
    if hf_steps:
        out["transformers_step_s"] = statistics.median(hf_steps)
        out["transformers_forward_s"] = statistics.median(hf_forwards)
    return out


def _hf_step(hf: Any, ids: list[int], steps: int) -> float:
    x = torch.tensor([ids])
    times = []
    for n in (2, 2 + steps):
        start = time.perf_counter()
        hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        times.append(time.perf_counter() - start)
    return (times[1] - times[0]) / steps


def _hf_forward(hf: Any, ids: list[int]) -> float:
    cache = hf(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    token = torch.tensor([[11]])

    def one() -> None:
        hf(input_ids=token, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drop the token again: the context stays the same across repeats

    return median_seconds(one, 10)


@torch.inference_mode()
def prefill_breakdown(llm: LLM, hf: Any, image_size: int) -> dict[str, float]:
    engine = llm.llm_engine
    (request,) = make_workload(llm, 1, (image_size, image_size), 64, (1, 1), seed=3)
    prompt = request.prompt
    item = prompt.mm_items[0]
    model = engine.model
    encode = median_seconds(lambda: model.embed_multimodal([item]), 3)
    cfg = engine.model_config
    text, vision = cfg.text, cfg.vision
    lm_params = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.layers"))
    lm_flops = 2 * lm_params * prompt.num_tokens
    e = vision.embed_dim
    vision_flops = 2 * item.pixel_values.shape[0] * (vision.depth * 12 * e * e + vision.patch_dim * e)

    def ttft() -> None:
        engine.reset_prefix_cache()  # every repeat encodes and prefills from scratch
        engine.add_request(f"ttft{time.perf_counter_ns()}", prompt, SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()

    total = median_seconds(ttft, 3)
    out = {
        "prompt_tokens": prompt.num_tokens,
        "image_tokens": item.length,
        "vlmserve_ttft_s": total,
        "vlmserve_encode_s": encode,
        "vlmserve_encode_GFLOPs": vision_flops / encode / 1e9,
        "vlmserve_lm_prefill_GFLOPs": lm_flops / (total - encode) / 1e9,
    }
    del text
    if hf is not None:
        pixel_values = item.pixel_values
        grid = torch.tensor([item.grid_thw])
        hf_encode = median_seconds(lambda: hf.model.get_image_features(pixel_values, grid), 3)
        ids = torch.tensor([prompt.prompt_token_ids])
        kwargs = {"pixel_values": pixel_values, "image_grid_thw": grid, "mm_token_type_ids": (ids == 151655).int()}
        hf_total = median_seconds(lambda: hf(input_ids=ids, logits_to_keep=1, **kwargs), 3)
        out |= {
            "transformers_ttft_s": hf_total,
            "transformers_encode_s": hf_encode,
            "transformers_encode_GFLOPs": vision_flops / hf_encode / 1e9,
            "transformers_lm_prefill_GFLOPs": lm_flops / (hf_total - hf_encode) / 1e9,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vlmserve.bench.breakdown",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-hf", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from vlmserve.tools.tiny_checkpoint import bench_checkpoint_dir

        args.model = str(bench_checkpoint_dir())
    llm = LLM(args.model, dtype=args.dtype, device="cpu", max_model_len=2048, max_num_seqs=4)
    hf = None if args.no_hf else load_hf_model(Path(llm.llm_engine.model_dir), getattr(torch, args.dtype))
    decode = decode_breakdown(llm, args.context, hf)
    prefill = prefill_breakdown(llm, hf, args.image_size)
    _print_section(f"decode step, one request, {args.context} tokens of context:", decode)
    _print_section(f"prefill, one {args.image_size}x{args.image_size} image:", prefill)
    return 0


def _print_section(title: str, values: dict[str, float]) -> None:
    """Keys end in their unit: "_s" values print in milliseconds."""
    print(title)
    for key, value in values.items():
        label, unit = key.rsplit("_", 1)
        print(f"  {label:50s} {value * 1e3:9.2f} ms" if unit == "s" else f"  {label:50s} {value:9.2f} {unit}")


if __name__ == "__main__":
    raise SystemExit(main())
