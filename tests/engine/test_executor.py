"""Tensor parallelism's engine side: LLM(tensor_parallel_size=2) runs two rank processes (each
builds the model; once the layers shard themselves, its shard) and gives the single process's
tokens; a killed rank fails generate() within moments and leaves no process behind; ranks of a
second "node" (`vlmserve worker` on loopback) join the same group."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from vlmserve import LLM, SamplingParams
from vlmserve.engine.config import EngineConfig
from vlmserve.engine.executor import ExecutorError, MultiprocExecutor, check_tensor_parallel, free_port
from vlmserve.sampling_params import StructuredOutputsParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
ENGINE: dict[str, Any] = {"dtype": "float32", "device": "cpu", "max_model_len": 512, "kv_cache_memory_gib": 0.01}


def prompts(image: Image.Image) -> list[Any]:
    return [
        {"prompt": "Look: <|vision_start|><|image_pad|><|vision_end|>", "multi_modal_data": {"image": image}},
        "The capital of France",
        "One two three four",
    ]


def token_ids(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def single(tiny_dir: Path) -> LLM:
    return LLM(tiny_dir, **ENGINE)


@pytest.fixture(scope="module")
def two_ranks(tiny_dir: Path) -> Iterator[LLM]:
    llm = LLM(tiny_dir, tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.shutdown()


def executor(llm: LLM) -> MultiprocExecutor:
    found = llm.llm_engine.core.executor
    assert isinstance(found, MultiprocExecutor)
    return found


def test_two_ranks_give_the_single_process_tokens_and_agree_on_random_samples(
    single: LLM, two_ranks: LLM, images: dict[str, Image.Image]
) -> None:
    batch, params = prompts(images["wide"]), [GREEDY, SEEDED, GREEDY]
    expected = token_ids(single.generate(batch, params))
    assert token_ids(two_ranks.generate(batch, params)) == expected
    # Unseeded random samples: each rank's own generator would draw other tokens; every rank
    # must hold rank 0's (the requests stay with the runner until the next step forgets them).
    # One is held to a grammar: the engine core compiles it and fills its mask once for both ranks
    # (compiled before the batch, so that it runs beside the others rather than after them).
    unseeded = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    digits = SamplingParams(max_tokens=6, temperature=1.0, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"))
    two_ranks.generate("Digits:", digits)
    outputs = two_ranks.generate(batch, [unseeded, digits, unseeded])
    assert re.fullmatch("[0-9]{3}", outputs[1].outputs[0].text), outputs[1].outputs[0].text
    (held_0, digest_0), (held_1, digest_1) = executor(two_ranks).request_digests()
    # (the grammar's request may have ended a step earlier, and been forgotten already)
    assert held_0 == held_1 >= 2 and digest_0 == digest_1


def test_a_killed_rank_fails_generate_within_moments_and_no_rank_is_left(two_ranks: LLM) -> None:
    processes = list(executor(two_ranks).processes)
    core = two_ranks.llm_engine.core
    started = core.num_generation_tokens
    outcome: dict[str, BaseException | None] = {}

    def generate() -> None:
        try:
            two_ranks.generate(["Count to a thousand"] * 2, SamplingParams(max_tokens=400, ignore_eos=True))
            outcome["error"] = None
        except BaseException as e:  # what generate raised is the result
            outcome["error"] = e

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    waiting = threading.Event()
    while core.num_generation_tokens == started and thread.is_alive():  # until tokens come
        waiting.wait(0.01)
    os.kill(processes[1].pid, signal.SIGKILL)  # type: ignore[arg-type]
    thread.join(60)
    assert not thread.is_alive(), "generate() hung after a rank was killed"
    error = outcome["error"]
    assert isinstance(error, ExecutorError) and "rank 1 died" in str(error), error
    for process in processes:
        process.join(10)
    assert [p.is_alive() for p in processes] == [False, False]


def test_a_second_node_joins_by_vlmserve_worker(
    tiny_dir: Path, single: LLM, images: dict[str, Image.Image], tmp_path: Path
) -> None:
    port = free_port()
    command = [sys.executable, "-m", "vlmserve.entrypoints.cli", "worker", str(tiny_dir), "--device", "cpu"]
    command += ["-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"]
    command += ["--master-port", str(port)]
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        llm = LLM(tiny_dir, tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=port, **ENGINE)
        assert len(executor(llm).processes) == 1  # rank 0 here; rank 1 is the worker's
        batch = prompts(images["tall"])
        assert token_ids(llm.generate(batch, GREEDY)) == token_ids(single.generate(batch, GREEDY))
        llm.shutdown()
        assert worker.wait(60) == 0, (tmp_path / "worker.log").read_text()
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be at least 1, got 0"),
        ({"tensor_parallel_size": 3, "nnodes": 2, "master_port": 29500}, "3 does not split evenly over 2 nodes"),
        ({"tensor_parallel_size": 2, "nnodes": 2}, "nnodes > 1 needs master_port"),
        ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2, "master_port": 1}, "node_rank must be in 0..1"),
    ],
)
def test_a_bad_tensor_parallel_layout_is_refused_by_name(options: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **options)  # type: ignore[arg-type]


def test_more_ranks_than_cuda_devices_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = EngineConfig(model="m", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"needs 2 CUDA devices on this node, found 1"):
        check_tensor_parallel(config, torch.device("cuda"))
    check_tensor_parallel(config, torch.device("cpu"))  # CPU ranks share the host


def test_a_worker_for_node_0_is_refused_in_one_line(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vlmserve.entrypoints.cli import main

    assert main(["worker", str(tiny_dir), "-tp", "2", "--nnodes", "2", "--node-rank", "0", "--master-port", "1"]) == 2
    assert capsys.readouterr().err == (
        "vlmserve worker: error: --node-rank 0 runs the engine (vlmserve serve or chat); a worker is node 1 or above\n"
    )


def test_data_parallel_engines_take_disjoint_cuda_devices_for_their_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """-dp 2 -tp 2 on CUDA: engine k's ranks on cuda:2k and cuda:2k+1, never a device twice."""
    from vlmserve.api.dp_client import engine_configs
    from vlmserve.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    config = EngineConfig(model="m", device="cuda", tensor_parallel_size=2)
    configs, _ = engine_configs(config, 2, 0)
    assert [c.device for c in configs] == ["cuda:0", "cuda:2"]
    check_tensor_parallel(configs[1], torch.device(configs[1].device))  # cuda:2 and cuda:3 exist
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(UserError, match=r"needs 4 CUDA devices"):
        engine_configs(config, 2, 0)
    with pytest.raises(ValueError, match=r"needs 2 CUDA devices on this node from cuda:2, found 3"):
        check_tensor_parallel(configs[1], torch.device("cuda:2"))
