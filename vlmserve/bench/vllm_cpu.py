"""vlmserve against vLLM's CPU build, same checkpoint, requests and machine, rounds alternating:

    python -m vlmserve.bench.vllm_cpu --vllm-python PATH/TO/VLLM/VENV/bin/python [MODEL]

vLLM runs in its own environment (it pins its own torch and transformers; docs/benchmarks.md
says how it was installed there), as a worker process that loads once and then runs each round
when told (vllm_worker.py). Both engines get the same inputs: the prompt text with one image
placeholder and the PIL image, every request at once, greedy, eos ignored, no prefix caching.

Per round: the workload (`vlmserve bench`'s: 32 requests with a 448x448 image and ~64 words,
outputs spread over 32..256) -> useful output tokens/s; then its first request alone -> time
for 1 output token (encode + prefill) and per further token (the decode step:
(time for 1 + T tokens - time for 1) / T).
"""

from __future__ import annotations

import argparse
import json
import operator
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from vlmserve.arg_types import positive_int
from vlmserve.bench.worker_process import WorkerProcess, emit_report, round_medians
from vlmserve.bench.workload import make_workload, max_model_len_for
from vlmserve.entrypoints.llm import LLM
from vlmserve.sampling_params import SamplingParams


def _prompt_text(llm: LLM, token_ids: list[int]) -> str:
    """The prompt as text with one image placeholder per image (each engine expands it)."""
    pad = llm.llm_engine.model_config.image_token_id
    collapsed = [t for i, t in enumerate(token_ids) if t != pad or i == 0 or token_ids[i - 1] != pad]
    return llm.get_tokenizer().decode(collapsed, skip_special_tokens=False)


def _vlmserve_generate(llm: LLM, requests: list[dict[str, Any]], lens: list[int]) -> tuple[float, list[list[int]]]:
    llm.llm_engine.reset_prefix_cache()  # vLLM runs without prefix caching
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    start = time.perf_counter()
    outs = llm.generate(requests, params)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    if args.model is None:
        from vlmserve.tools.tiny_checkpoint import bench_checkpoint_dir

        args.model = str(bench_checkpoint_dir())
    max_model_len = max_model_len_for(args.image_size, args.input_len, args.output_len[1])
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device="cpu", max_model_len=max_model_len, max_num_seqs=args.num_requests)
    startup = time.perf_counter() - start
    size = (args.image_size, args.image_size)
    workload = make_workload(llm, args.num_requests, size, args.input_len, tuple(args.output_len), args.seed)
    folder = Path(tempfile.mkdtemp(prefix="vlmserve-vllm-"))
    try:  # the PNGs and workload.json are removed whatever happens
        specs: list[dict[str, Any]] = []
        requests: list[dict[str, Any]] = []
        for r in workload:
            text = _prompt_text(llm, r.prompt.prompt_token_ids)
            name = f"image{r.index}.png"  # PNG: lossless, vLLM reads the same pixels
            assert r.image is not None
            r.image.save(folder / name)
            specs.append({"text": text, "image": name, "output_len": r.output_len})
            requests.append({"prompt": text, "multi_modal_data": {"image": r.image}})
        lens = [s["output_len"] for s in specs]
        (folder / "workload.json").write_text(
            json.dumps(
                {
                    "dtype": args.dtype,
                    "max_model_len": max_model_len,
                    "max_num_seqs": args.num_requests,
                    "single_tokens": args.single_tokens,
                    "requests": specs,
                }
            )
        )
        _vlmserve_generate(llm, requests[:2], [4, 4])  # warm-up
        print("starting vLLM's worker (its start-up takes minutes)", flush=True)
        worker = WorkerProcess(
            args.vllm_python,
            "vllm_worker.py",
            [args.model, str(folder)],
            {"VLLM_CPU_KVCACHE_SPACE": "4"},  # GiB
        )
        rounds = []
        try:
            for round_index in range(args.rounds):
                ours_wall, ours_tokens = _vlmserve_generate(llm, requests, lens)
                theirs = worker.ask("workload")
                first, _ = _vlmserve_generate(llm, requests[:1], [1])
                full, _ = _vlmserve_generate(llm, requests[:1], [1 + args.single_tokens])
                theirs_single = worker.ask("single")
                ours_tps = sum(map(len, ours_tokens)) / ours_wall
                theirs_tps = theirs["output_tokens"] / theirs["wall_s"]
                ours_step = (full - first) / args.single_tokens
                theirs_step = (theirs_single["full_s"] - theirs_single["first_s"]) / args.single_tokens
                rounds.append(
                    {
                        "round": round_index + 1,
                        "vlmserve_tok_s": round(ours_tps, 2),
                        "vllm_tok_s": round(theirs_tps, 2),
                        "tok_s_x": round(ours_tps / theirs_tps, 2),
                        "vlmserve_step_ms": round(ours_step * 1e3, 1),
                        "vllm_step_ms": round(theirs_step * 1e3, 1),
                        "step_x": round(theirs_step / ours_step, 2),
                        "vlmserve_ttft_s": round(first, 3),
                        "vllm_ttft_s": round(theirs_single["first_s"], 3),
                        "identical_requests": sum(map(operator.eq, ours_tokens, theirs["token_ids"])),
                    }
                )
                print(json.dumps(rounds[-1]), flush=True)
        finally:
            worker.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ours_prompt_tokens = [r.prompt.num_tokens for r in workload]
    report = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": args.threads,
        "startup_s": {"vlmserve": round(startup, 2), "vllm": round(worker.ready["startup_s"], 2)},
        "same_prompt_lengths": ours_prompt_tokens == theirs["prompt_tokens"],
        "rounds": rounds,
        "medians": round_medians(rounds),
    }
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m vlmserve.bench.vllm_cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, help="checkpoint (default: the benchmark-size random Qwen2-VL)")
    p.add_argument("--vllm-python", required=True, help="the Python of the environment with vLLM's CPU build")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-requests", type=positive_int, default=32)
    p.add_argument("--image-size", type=positive_int, default=448)
    p.add_argument("--input-len", type=positive_int, default=64)
    p.add_argument("--output-len", type=positive_int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--single-tokens", type=positive_int, default=32, help="T of the decode-step timing")
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the report's JSON here")
    args = p.parse_args(argv)
    emit_report(run(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
