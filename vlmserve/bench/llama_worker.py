"""llama.cpp's side of `python -m vlmserve.bench.llama_cpp`: runs in a Python environment that
has llama-cpp-python (docs/benchmarks.md says how it was built), never imports vlmserve.

    LLAMA_PYTHON -P llama_worker.py MODEL.gguf THREADS CONTEXT

Loads the GGUF file, says `ready` on stdout, then answers one JSON line per command line read
from stdin: `{"prompt": [token ids], "tokens": T}` -> the time to evaluate the prompt and pick
one token greedily (`first_s`), the time for T more tokens (`decode_s`), and the T + 1 token ids;
`quit` ends it.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    path, threads, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(path, n_ctx=context, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    print(json.dumps({"ready": True, "startup_s": time.perf_counter() - start}), flush=True)

    def greedy() -> int:
        # The last evaluated token's logits, read from the context: Llama.scores holds them only
        # with logits_all=True, which would also run lm_head over every prompt token.
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        return int(np.argmax(logits))

    for line in sys.stdin:
        if line.strip() == "quit":
            break
        command = json.loads(line)
        llm.reset()
        start = time.perf_counter()
        llm.eval(command["prompt"])
        tokens = [greedy()]
        first = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(command["tokens"]):
            llm.eval(tokens[-1:])
            tokens.append(greedy())
        decode = time.perf_counter() - start
        print(json.dumps({"first_s": first, "decode_s": decode, "token_ids": tokens}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
