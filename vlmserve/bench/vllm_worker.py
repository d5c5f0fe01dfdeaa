"""vLLM's side of `python -m vlmserve.bench.vllm_cpu`: runs in a Python environment that has
vLLM's CPU build (docs/benchmarks.md says how it was installed), never imports vlmserve.

    VLLM_PYTHON vllm_worker.py MODEL WORKLOAD_DIR

WORKLOAD_DIR/workload.json lists the requests ({"text", "image", "output_len"}; images are PNG
files beside it) and the settings. The worker loads the model, says `ready` on stdout, then
answers one JSON line per command read from stdin:
  workload  every request at once: wall time, output tokens, each request's token ids
  single    the first request alone: time for 1 token and for 1 + T tokens (T = --single-tokens)
  quit
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> int:
    model, folder = sys.argv[1], Path(sys.argv[2])
    spec = json.loads((folder / "workload.json").read_text())
    from PIL import Image
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model,
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        enable_prefix_caching=False,  # vlmserve's runs start from empty caches too
        mm_processor_cache_gb=0,
        seed=0,
    )
    startup = time.perf_counter() - start
    requests = [
        {"prompt": r["text"], "multi_modal_data": {"image": Image.open(folder / r["image"]).convert("RGB")}}
        for r in spec["requests"]
    ]

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    llm.generate(requests[:2], [params(4), params(4)], use_tqdm=False)  # warm-up
    print(json.dumps({"ready": True, "startup_s": startup}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "workload":
            lens = [r["output_len"] for r in spec["requests"]]
            start = time.perf_counter()
            outs = llm.generate(requests, [params(n) for n in lens], use_tqdm=False)
            wall = time.perf_counter() - start
            answer = {
                "wall_s": wall,
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
                "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            }
        elif command == "single":
            times = []
            for n in (1, 1 + spec["single_tokens"]):
                start = time.perf_counter()
                llm.generate(requests[:1], params(n), use_tqdm=False)
                times.append(time.perf_counter() - start)
            answer = {"first_s": times[0], "full_s": times[1]}
        elif command == "quit":
            return 0
        else:
            answer = {"error": f"unknown command {command!r}"}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
