"""Real servers for the tests: `vlmserve serve` started as a subprocess on a free loopback port."""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from PIL import Image

from tests.conftest import random_image
from vlmserve.ipc import shm

API_KEY = "test-key-3f9a"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    api_key: str | None
    log: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kwargs) -> httpx.Response:  # type: ignore[no-untyped-def]
        return httpx.get(self.url + path, headers=self.headers, timeout=30, **kwargs)

    def post(self, path: str, body: object = None, **kwargs) -> httpx.Response:  # type: ignore[no-untyped-def]
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=120, **kwargs)

    def health(self) -> int:
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            return 0

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.health() == 200:
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"server not healthy in {timeout}s: {self.log.read_text()[-3000:]}")

    def engine_pid(self) -> int:
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        for pid in children:
            if "engine_process" in Path(f"/proc/{pid}/cmdline").read_text():
                return int(pid)
        raise RuntimeError("no engine process")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _terminal_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_server(
    model_dir: Path,
    tmp: Path,
    *extra: str,
    api_key: str | None = API_KEY,
    env: dict[str, str] | None = None,
    served_model_name: str | None = "tiny",
    wrap: tuple[str, ...] = (),
    new_session: bool = False,
    wait: bool = True,
) -> Server:
    """`served_model_name`: the name requests give (None: the server's default, the folder name).
    `wrap`: a command that execs the rest (the server keeps the PID Popen sees). `new_session`:
    the server in a process group of its own, as a terminal starts it (its signals go to the
    group); `wait`: until it is healthy."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    command = [
        *wrap,
        sys.executable,
        "-m",
        "vlmserve.entrypoints.cli",
        "serve",
        str(model_dir),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "16",
        "--kv-cache-memory-gib",
        "0.05",
        "--limit-images",
        "3",
        "--media-fetch-timeout",
        "2",
        "--engine-threads",
        "1",
        "--log-level",
        "warning",
        *(["--api-key", api_key] if api_key else []),
        *(["--served-model-name", served_model_name] if served_model_name else []),
        *extra,
    ]
    process = subprocess.Popen(
        command,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=new_session,
        # As a terminal's shell starts it: Ctrl-C's signal at its default, even where the tests
        # run in a background job of a non-interactive shell (which starts them ignoring SIGINT,
        # and a process keeps an ignored SIGINT ignored).
        preexec_fn=_terminal_signals if new_session else None,
    )
    _OUR_PIDS.add(process.pid)
    server = Server(process, f"http://127.0.0.1:{port}", api_key, log)
    try:
        if wait:
            server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server


# The default servers (`server`: Qwen2-VL, `qwen25_server`: Qwen2.5-VL, `qwen_server`: Qwen-VL-Chat,
# `qwen3_server`: Qwen3-VL)
# are session fixtures in tests/conftest.py, shared with the families' conformance suite.


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def image_message(url: str, text: str = "What is this?") -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}
    ]


def picture(seed: int = 1, size: tuple[int, int] = (120, 80)) -> Image.Image:
    return random_image(*size, seed=seed)


# This test session's processes: itself and the servers it started. Only their segments are the
# tests' business; another vlmserve on the same machine (another checkout's tests) has its own.
_OUR_PIDS: set[int] = {os.getpid()}


def segments_left() -> list[str]:
    """Shared-memory segments written by this session's processes and not yet removed."""
    return [name for name in shm.list_segments() if int(name.split("-")[1]) in _OUR_PIDS]
