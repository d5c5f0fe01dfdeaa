"""vlmserve against llama.cpp (llama-cpp-python) on one request's decode step, same language model,
same token ids, same machine, rounds alternating:

    python -m vlmserve.bench.llama_cpp --llama-python PATH/TO/VENV/bin/python \\
        --gguf bf16=MODEL-bf16.gguf --gguf q8_0=MODEL-q8_0.gguf MODEL

MODEL is the Hugging Face checkpoint the GGUF files were converted from (llama.cpp's
convert_hf_to_gguf.py; docs/benchmarks.md says how). The prompt is token ids only (no image: the
GGUF files hold the language model), the same ids for both engines; each engine evaluates it and
picks one token greedily (`first`), then decodes T more; the decode step is (time for 1 + T tokens
- time for 1) / T for vlmserve, the T single-token evaluations for llama.cpp. llama.cpp runs in
its own environment as a worker process per GGUF file (llama_worker.py), loaded once.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from vlmserve.arg_types import positive_int
from vlmserve.bench.worker_process import WorkerProcess, emit_report, round_medians
from vlmserve.entrypoints.llm import LLM
from vlmserve.sampling_params import SamplingParams


def _timed(llm: LLM, prompt: list[int], n: int) -> tuple[float, list[int]]:
    llm.llm_engine.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    (out,) = llm.generate({"prompt_token_ids": prompt}, params)
    return time.perf_counter() - start, list(out.outputs[0].token_ids)


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    files = dict(spec.split("=", 1) for spec in args.gguf)
    context = args.prompt_tokens + args.tokens + 16
    generator = torch.Generator().manual_seed(args.seed)
    # Ordinary vocabulary ids (below the special tokens), the same for both engines.
    prompt = torch.randint(1000, 100000, (args.prompt_tokens,), generator=generator).tolist()
    start = time.perf_counter()
    llm = LLM(args.model, dtype="bfloat16", device="cpu", max_model_len=context, quantization=args.quantization)
    startup = time.perf_counter() - start
    _timed(llm, prompt[:8], 2)  # warm-up
    workers = {
        name: WorkerProcess(args.llama_python, "llama_worker.py", [path, str(args.threads), str(context)])
        for name, path in files.items()
    }
    ours_name = f"vlmserve {args.quantization or 'bf16'}"
    rounds: list[dict[str, Any]] = []
    try:
        for worker in workers.values():  # warm-up
            worker.ask(json.dumps({"prompt": prompt[:8], "tokens": 2}))
        for r in range(args.rounds):
            first, _ = _timed(llm, prompt, 1)
            full, ours_tokens = _timed(llm, prompt, 1 + args.tokens)
            row: dict[str, Any] = {
                "round": r + 1,
                f"{ours_name} step_ms": round((full - first) / args.tokens * 1e3, 1),
                f"{ours_name} prefill_s": round(first, 3),
            }
            for name, worker in workers.items():
                answer = worker.ask(json.dumps({"prompt": prompt, "tokens": args.tokens}))
                row[f"llama.cpp {name} step_ms"] = round(answer["decode_s"] / args.tokens * 1e3, 1)
                row[f"llama.cpp {name} prefill_s"] = round(answer["first_s"], 3)
                row[f"same tokens as llama.cpp {name}"] = sum(
                    a == b for a, b in zip(ours_tokens, answer["token_ids"], strict=False)
                )
            rounds.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    report = {
        "model": args.model,
        "gguf": files,
        "quantization": args.quantization,
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.tokens,
        "startup_s": {ours_name: round(startup, 2)}
        | {f"llama.cpp {name}": round(w.ready["startup_s"], 2) for name, w in workers.items()},
        "rounds": rounds,
        "medians": round_medians(rounds),
    }
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m vlmserve.bench.llama_cpp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="the Hugging Face checkpoint the GGUF files were converted from")
    p.add_argument("--llama-python", required=True, help="the Python of the environment with llama-cpp-python")
    p.add_argument(
        "--gguf", action="append", required=True, metavar="NAME=PATH", help="a GGUF file and its name (repeatable)"
    )
    p.add_argument("--quantization", choices=["int8"], default=None, help="vlmserve's weight-only quantization")
    p.add_argument("--prompt-tokens", type=positive_int, default=341)
    p.add_argument("--tokens", type=positive_int, default=64, help="T: decode steps timed")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the report's JSON here")
    args = p.parse_args(argv)
    if any("=" not in spec for spec in args.gguf):
        p.error("--gguf takes NAME=PATH")
    emit_report(run(args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
