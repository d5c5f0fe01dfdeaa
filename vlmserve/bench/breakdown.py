"""Where the time of one request goes, measured: `python -m vlmserve.bench.breakdown [MODEL]`.

Decode step (one request, a few hundred tokens of context):
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
import functools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vlmserve.bench.run_hf import load_hf_model
from vlmserve.bench.workload import make_workload
from vlmserve.entrypoints.llm import LLM
from vlmserve.models.layers import Linear
from vlmserve.sampling_params import SamplingParams


def _time(fn: Callable[[], object], repeat: int = 10) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


@torch.inference_mode()
def decode_breakdown(llm: LLM, context: int, hf: Any) -> dict[str, float]:
    engine = llm.llm_engine
    model = engine.model
    ids = torch.randint(0, 150000, (context,)).tolist()
    # Engine step: one request decoding (measured over a run of steps after its prefill).
    steps = 24
    engine.add_request("bd", llm.llm_engine.processor.process(ids, []), SamplingParams(temperature=0,
                       max_tokens=steps + 2, ignore_eos=True))  # fmt: skip
    engine.step()  # prefill
    engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step = (time.perf_counter() - t) / steps
    engine.abort_request("bd")

    # The matrix-vector products alone.
    lm_linears = [m for name, m in model.named_modules() if isinstance(m, Linear) and not name.startswith("visual")]
    matmul = 0.0
    streamed = 0
    for linear in lm_linears:
        x = torch.randn(1, linear.in_features, dtype=linear.weight.dtype)
        matmul += _time(functools.partial(linear, x), repeat=5)
        streamed += linear.weight.numel() * linear.weight.element_size()

    # The runner's decode step alone (batch building, forward, logits, sampling), repeated on the
    # same scheduled step.
    request_ids = torch.randint(0, 150000, (context,)).tolist()
    runner = engine.runner
    engine.add_request("fw", engine.processor.process(request_ids, []), SamplingParams(max_tokens=4, ignore_eos=True))
    sched = engine.scheduler.schedule()
    runner.execute(sched)
    engine.scheduler.update_from_output(sched, {"fw": 1})
    decode = engine.scheduler.schedule()
    forward = _time(lambda: runner.execute(decode), repeat=10)
    engine.scheduler.update_from_output(decode, {})
    engine.abort_request("fw")

    out = {
        "vlmserve_step_s": step,
        "vlmserve_runner_s": forward,
        "vlmserve_matmuls_s": matmul,
        "weights_streamed_GB": streamed / 1e9,
        "vlmserve_matmul_GBps": streamed / matmul / 1e9,
    }
    if hf is not None:
        inputs = torch.tensor([ids])
        with torch.no_grad():
            prefill = hf(input_ids=inputs, use_cache=True)
            cache = prefill.past_key_values
            token = torch.tensor([[11]])

            def one() -> None:
                hf(input_ids=token, past_key_values=cache, use_cache=True)
                cache.crop(-1)  # drop the token again: the context stays the same across repeats

            out["transformers_forward_s"] = _time(one, repeat=10)
            t = time.perf_counter()
            hf.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=2, min_new_tokens=2,
                        do_sample=False)  # fmt: skip
            t2 = time.perf_counter()
            hf.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=2 + steps,
                        min_new_tokens=2 + steps, do_sample=False)  # fmt: skip
            t3 = time.perf_counter()
            out["transformers_step_s"] = ((t3 - t2) - (t2 - t)) / steps
    return out


@torch.inference_mode()
def prefill_breakdown(llm: LLM, hf: Any, image_size: int) -> dict[str, float]:
    engine = llm.llm_engine
    (request,) = make_workload(llm, 1, (image_size, image_size), 64, (1, 1), seed=3)
    prompt = request.prompt
    item = prompt.mm_items[0]
    model = engine.model
    encode = _time(lambda: model.embed_multimodal([item]), repeat=3)
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

    total = _time(ttft, repeat=3)
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
        hf_encode = _time(lambda: hf.model.get_image_features(pixel_values, grid), repeat=3)
        ids = torch.tensor([prompt.prompt_token_ids])
        kwargs = {"pixel_values": pixel_values, "image_grid_thw": grid, "mm_token_type_ids": (ids == 151655).int()}
        hf_total = _time(lambda: hf(input_ids=ids, logits_to_keep=1, **kwargs), repeat=3)
        out |= {
            "transformers_ttft_s": hf_total,
            "transformers_encode_s": hf_encode,
            "transformers_encode_GFLOPs": vision_flops / hf_encode / 1e9,
            "transformers_lm_prefill_GFLOPs": lm_flops / (hf_total - hf_encode) / 1e9,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlmserve.bench.breakdown", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
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
    decode["vlmserve: runner - matmuls_s"] = decode["vlmserve_runner_s"] - decode["vlmserve_matmuls_s"]
    decode["vlmserve: step - runner_s"] = decode["vlmserve_step_s"] - decode["vlmserve_runner_s"]
    if hf is not None:
        decode["transformers: step - forward_s"] = decode["transformers_step_s"] - decode["transformers_forward_s"]
    print(f"decode step, one request, {args.context} tokens of context:")
    for key, value in decode.items():
        print(f"  {key:32s} {value * 1e3:9.2f} ms" if key.endswith("_s") else f"  {key:32s} {value:9.2f}")
    print(f"prefill, one {args.image_size}x{args.image_size} image:")
    for key, value in prefill.items():
        print(f"  {key:32s} {value * 1e3:9.2f} ms" if key.endswith("_s") else f"  {key:32s} {value:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
