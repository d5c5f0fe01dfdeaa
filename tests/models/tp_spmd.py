"""One rank of a tensor-parallel group running the whole offline engine SPMD (every rank the same
engine on the same prompts), or the single-process run it is compared with.

    python -m tests.models.tp_spmd RANK WORLD_SIZE PORT OUT_JSON CHECKPOINT_DIR...

joins the gloo group on 127.0.0.1:PORT and writes, per checkpoint, what run_checkpoint returns."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

from tests.conftest import random_image
from vlmserve import LLM, SamplingParams
from vlmserve.models.parallel import spec_of

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_TOKENS = 4


def chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def prompts() -> list[Any]:
    wide, tall, small = random_image(150, 100, seed=1), random_image(70, 190, seed=2), random_image(40, 30, seed=3)
    return [
        {"prompt": chat(f"{PAD}What is in this image?"), "multi_modal_data": {"image": [wide]}},
        {"prompt": chat(f"{PAD}{PAD}Which is darker?"), "multi_modal_data": {"image": [tall, small]}},
        chat("Tell me a story about a lighthouse."),
    ]


def parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of all parameters, bytes of those every rank holds whole: no ShardSpec)."""
    total = replicated = 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            n = p.numel() * p.element_size()
            total += n
            replicated += n if spec_of(module, name) is None else 0
    return total, replicated


def run_checkpoint(model_dir: str) -> dict[str, Any]:
    """Greedy tokens with their top-5 logprobs, the prompts batched, and the parameter bytes this
    process holds."""
    llm = LLM(
        model_dir, dtype="float32", max_model_len=1024, kv_cache_memory_gib=0.01, limit_mm_per_prompt={"image": 2}
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    outputs = llm.generate(prompts(), params)
    total, replicated = parameter_bytes(llm.llm_engine.model)
    result = {
        "tokens": [o.outputs[0].token_ids for o in outputs],
        # [prompt][step] -> the top-5 logprobs, best first
        "logprobs": [[sorted(v.logprob for v in step.values()) for step in o.outputs[0].logprobs] for o in outputs],
        "param_bytes": total,
        "replicated_bytes": replicated,
    }
    del llm, outputs
    gc.collect()
    return result


def main() -> None:
    rank, world_size, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    torch.set_num_threads(1)
    from vlmserve.distributed import destroy_tensor_parallel, init_tensor_parallel

    init_tensor_parallel(rank, world_size, torch.device("cpu"), f"tcp://127.0.0.1:{port}", timeout_s=300)
    try:
        results = {d: run_checkpoint(d) for d in sys.argv[5:]}
    finally:
        destroy_tensor_parallel()
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
