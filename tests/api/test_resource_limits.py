"""Resource limits against the real server (issue 13): shared memory for pixels, and the work
one image may cost. Each bad request gets a 4xx/503 naming the limit, while the requests beside
it complete as they would alone, /health stays 200, the engine keeps its PID and no segment is
left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.api.conftest import Server, data_url, free_port, image_message, picture, segments_left, start_server
from vlmserve.ipc import shm

SMALL = (120, 80)  # 48 patches: 225,792 bytes of float32 pixels
BIG = (448, 448)  # 1,024 patches: 4,816,896 bytes
HUGE = (700, 700)  # 2,500 patches: 11,760,000 bytes


def chat(server: Server, size: tuple[int, int], seed: int = 1) -> tuple[int, dict]:
    body = {
        "model": "tiny",
        "messages": image_message(data_url(picture(seed, size))),
        "max_tokens": 8,
        "temperature": 0,
    }
    r = server.post("/v1/chat/completions", body)
    return r.status_code, r.json()


def check_error(body: dict, *words: str) -> str:
    message = body["error"]["message"]
    assert "Traceback" not in message and "File " not in message
    for word in words:
        assert word in message, message
    return message


# -- the total of segments in flight -------------------------------------------------------------


def test_write_array_past_the_total_in_flight_is_a_503_and_leaves_nothing() -> None:
    shm.set_max_bytes(1000)
    try:
        held = shm.write_array(np.zeros(200, dtype=np.float32))  # 800 bytes in flight
        with pytest.raises(shm.SharedMemoryFull) as busy:
            shm.write_array(np.zeros(100, dtype=np.float32))
        assert busy.value.status == 503 and "800 bytes of pixels in flight" in busy.value.message
        with pytest.raises(shm.SharedMemoryFull) as never:
            shm.write_array(np.zeros(1000, dtype=np.float32))
        assert never.value.status == 413 and "4000 bytes" in never.value.message
        shm.unlink(held.name)
        shm.write_array(np.zeros(100, dtype=np.float32))  # room again once the first is gone
    finally:
        shm.set_max_bytes(None)
        for name in shm.list_segments():
            if name.startswith(f"{shm.PREFIX}{os.getpid()}-"):
                shm.unlink(name)


@pytest.fixture(scope="module")
def shm_capped(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tiny_dir, tmp_path_factory.mktemp("shm-capped"), "--max-shm-bytes", "1000000")
    yield s
    s.stop()


def test_an_image_over_max_shm_bytes_gets_413_while_the_others_complete_unchanged(shm_capped: Server) -> None:
    alone = [chat(shm_capped, SMALL, seed) for seed in (1, 2)]
    assert all(status == 200 for status, _ in alone)
    engine = shm_capped.engine_pid()
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(chat, shm_capped, SMALL, 1), pool.submit(chat, shm_capped, BIG, 3)]
        futures.append(pool.submit(chat, shm_capped, SMALL, 2))
        (s1, b1), (sb, bb), (s2, b2) = (f.result() for f in futures)
    assert sb == 413
    check_error(bb, "shared memory", "4816896 bytes", "--max-shm-bytes")
    assert (s1, s2) == (200, 200)
    assert b1["choices"][0]["message"] == alone[0][1]["choices"][0]["message"]
    assert b2["choices"][0]["message"] == alone[1][1]["choices"][0]["message"]
    assert shm_capped.health() == 200 and shm_capped.engine_pid() == engine
    assert segments_left() == []


# -- a small /dev/shm: a private tmpfs in a user + mount namespace ---------------------------------


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True
    )
    return probe.returncode == 0


@pytest.fixture(scope="module")
def small_shm(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The server in its own mount namespace whose /dev/shm is an 8 MiB tmpfs (Docker's default is
    64 MiB); --max-shm-bytes far above it, so that only the filesystem can say no."""
    if not _namespaces_work():
        pytest.skip("user + mount namespaces are not available here (unshare -Urm failed)")
    tmp = tmp_path_factory.mktemp("small-shm")
    port = free_port()
    log = tmp / "server.log"
    serve = [sys.executable, "-m", "vlmserve.entrypoints.cli", "serve", str(tiny_dir), "--port", str(port)]
    serve += ["--dtype", "float32", "--max-model-len", "4096", "--kv-cache-memory-gib", "0.05"]
    serve += ["--engine-threads", "1", "--log-level", "warning", "--max-shm-bytes", str(1 << 30)]
    serve += ["--served-model-name", "tiny"]
    # unshare and sh exec: the server keeps the PID Popen sees.
    command = ["unshare", "-Urm", "sh", "-c", 'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$@"', "sh", *serve]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ})
    s = Server(process, f"http://127.0.0.1:{port}", None, log)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def test_a_full_dev_shm_gets_503_naming_its_free_space_and_the_server_lives(small_shm: Server) -> None:
    private = Path(f"/proc/{small_shm.process.pid}/root/dev/shm")
    assert shutil.disk_usage(private).total <= 8 << 20  # the namespace's tmpfs, not the host's
    status, alone = chat(small_shm, SMALL)
    assert status == 200, alone
    engine = small_shm.engine_pid()
    filler = private / "filler"
    filler.write_bytes(b"\0" * (6 << 20))  # about 2 MiB left: the big image's 4.8 MB cannot be backed
    # What is free exactly (a process may hold an unlinked semaphore page there, e.g. tqdm's lock).
    free = shutil.disk_usage(private).free
    assert 0 < free <= 2 << 20
    try:
        status, body = chat(small_shm, BIG, 3)
        assert status == 503
        check_error(body, f"/dev/shm has {free} bytes", "free", "4816896 bytes", "--shm-size")
        assert small_shm.process.poll() is None and small_shm.health() == 200
        status, again = chat(small_shm, SMALL)  # what fits still goes through
        assert status == 200 and again["choices"][0]["message"] == alone["choices"][0]["message"]
    finally:
        filler.unlink()
    status, body = chat(small_shm, HUGE, 4)  # over the whole filesystem: never fits
    assert status == 413
    check_error(body, "/dev/shm is 8.0 MiB", "11760000 bytes", "--shm-size")
    assert chat(small_shm, BIG, 3)[0] == 200  # room again once the filler is gone
    assert small_shm.health() == 200 and small_shm.engine_pid() == engine
    assert [p.name for p in private.iterdir()] == []
