"""The API process's memory around large-image requests (issue 13, item 7).

    python -m vlmserve.bench.api_memory [MODEL] [--side 4000] [--concurrency 4] [--rounds 3]

Starts `vlmserve serve` (default: the tiny random Qwen2-VL, with --max-pixels 1003520 so that a
4000x4000 image is resized to 980x980, 1225 tokens, within the budget), then sends --rounds
rounds of --concurrency chat requests at once, each with --images-per-request images of --side x
--side pixels (a JPEG photo, or a PNG of one colour), and prints the API process's resident
memory (/proc/PID/status: VmRSS, of which RssAnon is its own heap) when idle, at its peak in each
round (sampled every 10 ms), and a second after each round. Memory not returned after a round is
what the process keeps holding while idle. Results: docs/security.md.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _memory(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssShmem of `pid`, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssShmem"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


class _PeakSampler:
    """The largest VmRSS (and its RssAnon) of a process while running."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = _memory(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            now = _memory(self.pid)
            if now["VmRSS"] > self.peak["VmRSS"]:
                self.peak = now

    def __enter__(self) -> _PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _image_url(side: int, fmt: str, seed: int) -> str:
    """A data URL: a photo-like JPEG (smooth colour plus noise), or a PNG of one colour (the
    issue's case: a small file that decodes to side x side pixels)."""
    rng = np.random.default_rng(seed)
    if fmt == "PNG":
        image = Image.new("RGB", (side, side), tuple(int(c) for c in rng.integers(0, 256, 3)))
    else:
        low = Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).resize((side, side))
        noise = rng.integers(-12, 12, (side, side, 3), dtype=np.int16)
        image = Image.fromarray(np.clip(np.asarray(low, dtype=np.int16) + noise, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    image.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _ask(base: str, image_urls: list[str]) -> int:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "What?"}]}]
    body = {"model": "bench", "messages": messages, "max_tokens": 2, "temperature": 0.0}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=600).status_code


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="checkpoint (default: the tiny random Qwen2-VL)")
    p.add_argument("--side", type=int, default=4000, help="images of side x side pixels")
    p.add_argument("--format", default="JPEG", choices=["JPEG", "PNG"])
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--images-per-request", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-pixels", type=int, default=1003520, help="the server's --max-pixels")
    p.add_argument("--server-arg", action="append", default=[], help="one more argument for vlmserve serve")
    args = p.parse_args(argv)
    if args.model is None:
        from vlmserve.tools.tiny_checkpoint import tiny_checkpoint_dir

        args.model = str(tiny_checkpoint_dir())

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "vlmserve.entrypoints.cli",
        "serve",
        args.model,
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--max-pixels",
        str(args.max_pixels),
        "--max-model-len",
        "4096",
        "--kv-cache-memory-gib",
        "0.1",
        "--engine-threads",
        "1",
        "--log-level",
        "warning",
        *args.server_arg,
    ]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        n = args.images_per_request
        images = [[_image_url(args.side, args.format, r * n + k) for k in range(n)] for r in range(args.concurrency)]
        assert _ask(base, [_image_url(64, args.format, 0)]) == 200  # imports and first-use allocations done
        time.sleep(1)
        idle = _memory(server.pid)
        print(
            f"API process {server.pid}; {args.concurrency} concurrent requests of {n} {args.side}x{args.side} "
            f"{args.format} image(s)"
        )
        print(f"{'':>12} {'VmRSS MiB':>10} {'RssAnon MiB':>12}")
        print(f"{'idle':>12} {idle['VmRSS'] / MiB:>10.0f} {idle['RssAnon'] / MiB:>12.0f}")
        for k in range(args.rounds):
            with _PeakSampler(server.pid) as sampler, ThreadPoolExecutor(args.concurrency) as pool:
                codes = list(pool.map(lambda urls: _ask(base, urls), images))
            if any(code != 200 for code in codes):
                raise SystemExit(f"requests answered {codes}")
            time.sleep(1)
            after = _memory(server.pid)
            peak = sampler.peak
            print(f"{f'round {k + 1} peak':>12} {peak['VmRSS'] / MiB:>10.0f} {peak['RssAnon'] / MiB:>12.0f}")
            print(f"{f'round {k + 1} after':>12} {after['VmRSS'] / MiB:>10.0f} {after['RssAnon'] / MiB:>12.0f}")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.kill(server.pid, signal.SIGKILL)
            server.wait()


if __name__ == "__main__":
    main()
