"""A plain request's latency beside heavy ones: what one client's request costs the others.

    python -m vlmserve.bench.request_cost MODEL [--src DIR] [--port 8321]

Starts `vlmserve serve MODEL` (float32, max_model_len 4096; from the source tree `--src` if given,
to compare with another checkout), times a plain 8-token chat request (no sampling fields: the
checkpoint's generation_config.json) alone (median of 5), then
sends each heavy load below (one or more heavy requests at once) and, 0.5 s later, three plain
requests one after another, and prints what the heavy ones got and how long each plain one took.
The machine is shared: compare within one run."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

PLAIN = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}  # the checkpoint's sampling
LONG_PROMPT = " ".join(["word"] * 1000)
# name -> (the heavy request, how many of it are sent at once)
HEAVY: dict[str, tuple[dict[str, Any], int]] = {
    "beam search, n 8 x 8 prompts (64 sequences)": ({
        "prompt": ["hello"] * 8, "n": 8, "use_beam_search": True, "max_tokens": 48, "ignore_eos": True
    }, 1),
    "beam search, n 8 x 4 prompts (32 sequences)": ({
        "prompt": ["hello"] * 4, "n": 8, "use_beam_search": True, "max_tokens": 48, "ignore_eos": True
    }, 1),
    "8 prompts of ~1000 tokens, n 4, prompt_logprobs 20": ({
        "prompt": [LONG_PROMPT] * 8, "n": 4, "logprobs": 20, "prompt_logprobs": 20, "max_tokens": 8
    }, 1),
    "8 distinct prompts of ~1000 tokens, n 4 (32 sequences, 8,000 prompt tokens)": ({
        "prompt": [f"{i} {LONG_PROMPT}" for i in range(8)], "n": 4, "max_tokens": 8
    }, 1),
    "3 requests of 8 prompts x n 4, 200 tokens (96 sequences for 64 places)": ({
        "prompt": ["hello"] * 8, "n": 4, "max_tokens": 200, "ignore_eos": True
    }, 3),
}  # fmt: skip


def _start(model: str, port: int, src: Path | None) -> subprocess.Popen[bytes]:
    env = {**os.environ, **({"PYTHONPATH": str(src)} if src else {})}
    command = [sys.executable, "-m", "vlmserve.entrypoints.cli", "serve", model, "--port", str(port)]
    command += ["--dtype", "float32", "--max-model-len", "4096", "--served-model-name", "tiny"]
    # The source tree is the working directory too: it comes first on sys.path.
    return subprocess.Popen(command, env=env, cwd=src, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _plain(url: str) -> tuple[int, float]:
    start = time.monotonic()
    response = httpx.post(url + "/v1/chat/completions", json=PLAIN, timeout=300)
    return response.status_code, time.monotonic() - start


def run(model: str, port: int, src: Path | None) -> None:
    server = _start(model, port, src)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        _plain(url)
        print(f"plain alone: {statistics.median(_plain(url)[1] for _ in range(5)):.3f} s")
        for name, (fields, copies) in HEAVY.items():
            results: list[str] = []

            def heavy(fields: dict[str, Any] = fields, results: list[str] = results) -> None:
                start = time.monotonic()
                response = httpx.post(url + "/v1/completions", json={"model": "tiny", **fields}, timeout=300)
                ok = response.status_code == 200
                answer = 200 if ok else f"{response.status_code} {response.json()['error']['message'][:100]}"
                results.append(f"{answer} in {time.monotonic() - start:.2f} s")

            threads = [threading.Thread(target=heavy) for _ in range(copies)]
            for thread in threads:
                thread.start()
                time.sleep(0.05)  # in this order
            time.sleep(0.5)
            beside = [_plain(url) for _ in range(3)]
            for thread in threads:
                thread.join(360)
            plain = ", ".join(f"{s:.2f} s ({status})" for status, s in beside)
            print(f"{name}: {'; '.join(results)}; plain beside: {plain}")
    finally:
        server.terminate()
        server.wait(60)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vlmserve.bench.request_cost", description=__doc__)
    parser.add_argument("model", help="checkpoint directory (a tiny one: vlmserve make-tiny DIR)")
    parser.add_argument("--src", type=Path, default=None, help="a vlmserve source tree to run the server from")
    parser.add_argument("--port", type=int, default=8321)
    args = parser.parse_args(argv)
    run(args.model, args.port, args.src)


if __name__ == "__main__":
    main()
