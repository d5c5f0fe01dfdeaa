"""Between the engine core and the model: the executor runs each call the core makes (plan the
memory, bind the caches, execute a step) on every tensor-parallel rank and returns rank 0's answer.

tensor_parallel_size 1: InProcessExecutor, one Worker in this process (no process, no messages).
tensor_parallel_size N: MultiprocExecutor, N rank processes in a torch.distributed group
(engine/worker.py). The core sends each call to rank 0 over a pipe (msgspec bytes, no pickle);
rank 0 broadcasts it to the other ranks, every rank runs it, rank 0 replies. While it waits, the
executor watches every local rank's process: a dead rank (or one that failed outside any one
request) is an ExecutorError within moments, and the other ranks are stopped."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import time
import weakref
from pathlib import Path
from typing import NoReturn, Protocol

import torch

from vlmserve.attention import AttentionBackend
from vlmserve.engine.config import EngineConfig
from vlmserve.engine.model_runner import ModelRunner
from vlmserve.engine.step_isolation import execute_or_isolate
from vlmserve.engine.worker import (
    RANK_BEAT_S,
    RankSpec,
    Worker,
    new_beats,
    spawn_ranks,
    stop_ranks,
    worker_setup_json,
)
from vlmserve.ipc import serial
from vlmserve.ipc.contracts import SchedulerOutput
from vlmserve.ipc.worker_messages import (
    AddLoRA,
    BindCaches,
    DigestRequests,
    Execute,
    FreeEncoderOutputs,
    Plan,
    RankInfo,
    RemoveLoRA,
    Reply,
    Reset,
    Shutdown,
    StepResult,
    WorkerCall,
    reply_decoder,
)
from vlmserve.lora.request import AdapterInfo, LoRAError, LoRARequest
from vlmserve.models.base import VLModel
from vlmserve.multimodal.inputs import MultiModalItem

logger = logging.getLogger(__name__)


class ExecutorError(RuntimeError):
    """A rank died, or failed outside any one request: the engine cannot go on (the server's
    engine process exits and is restarted; the offline LLM raises this)."""


class Executor(Protocol):
    tensor_parallel_size: int

    def plan(
        self,
        dummy_items: list[MultiModalItem] | None,
        num_tokens: int = 0,
        max_model_len: int = 0,
        num_seqs: int = 0,
        block_size: int = 0,
    ) -> list[RankInfo]:
        """Each rank's weights, KV bytes per token, slot bytes and budget; with dummy
        items (the worst case the limits admit), each rank's profile-step peak too."""
        ...

    def bind_caches(self, num_blocks: int, block_size: int, group_slots: list[int]) -> None:
        """The paged KV's blocks and each slot group's slots, on every rank."""
        ...

    def execute(self, step: SchedulerOutput) -> StepResult: ...

    def free_encoder_outputs(self, content_hashes: list[str]) -> None: ...

    def add_lora(self, lora: LoRARequest) -> AdapterInfo:
        """Read and check an adapter on every rank: LoRAError (the message rank 0 gave) where it
        cannot be served; the engine goes on either way."""
        ...

    def remove_lora(self, lora_name: str) -> None: ...

    def reset(self) -> None: ...

    def shutdown(self) -> None: ...


class InProcessExecutor:
    """The model and its runner in this process: the engine as it was before executors."""

    tensor_parallel_size = 1

    def __init__(self, config: EngineConfig, model_dir: Path, device: torch.device, backend: AttentionBackend) -> None:
        self.worker = Worker(config, model_dir, device, backend)
        self.model: VLModel = self.worker.model
        self.runner: ModelRunner = self.worker.runner

    def plan(
        self,
        dummy_items: list[MultiModalItem] | None,
        num_tokens: int = 0,
        max_model_len: int = 0,
        num_seqs: int = 0,
        block_size: int = 0,
    ) -> list[RankInfo]:
        profile = dummy_items is not None
        call = Plan(profile, dummy_items or [], num_tokens, max_model_len, num_seqs, block_size)
        return [self.worker.plan(call)]

    def bind_caches(self, num_blocks: int, block_size: int, group_slots: list[int]) -> None:
        self.runner.bind_caches(num_blocks, block_size, group_slots)

    def execute(self, step: SchedulerOutput) -> StepResult:
        return execute_or_isolate(self.runner, step)

    def free_encoder_outputs(self, content_hashes: list[str]) -> None:
        self.runner.free_encoder_outputs(content_hashes)

    def add_lora(self, lora: LoRARequest) -> AdapterInfo:
        return _adapter_info(self.worker.add_lora(lora))

    def remove_lora(self, lora_name: str) -> None:
        self.worker.handle(RemoveLoRA(lora_name))

    def reset(self) -> None:
        self.runner.reset()

    def shutdown(self) -> None:
        pass


def _adapter_info(reply: Reply) -> AdapterInfo:
    if reply.lora_error is not None:
        raise LoRAError(reply.lora_error)
    assert reply.lora is not None, "a rank answered AddLoRA without the adapter"
    return reply.lora


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check_tensor_parallel(config: EngineConfig, device: torch.device) -> None:
    """ValueError naming what is wrong with the tensor-parallel options for this machine."""
    local = config.tensor_parallel_size // config.nnodes
    first = device.index or 0  # the node's ranks take cuda:first .. cuda:first + local - 1
    if device.type == "cuda" and first + local > torch.cuda.device_count():
        where = f" from cuda:{first}" if first else ""
        raise ValueError(
            f"tensor_parallel_size {config.tensor_parallel_size} over {config.nnodes} node(s) needs {local} CUDA "
            f"devices on this node{where}, found {torch.cuda.device_count()}"
        )


class MultiprocExecutor:
    """This node's ranks as processes; rank 0's pipe carries the calls and the replies."""

    def __init__(self, config: EngineConfig, model_dir: Path, device: torch.device) -> None:
        check_tensor_parallel(config, device)
        self.tensor_parallel_size = size = config.tensor_parallel_size
        local = size // config.nnodes
        port = config.master_port or free_port()
        # Rank 0 is on node 0, with the engine core; other nodes' ranks join by `vlmserve worker`.
        self._conn, rank0_end = multiprocessing.get_context("spawn").Pipe()
        threads = max(1, torch.get_num_threads() // local)
        setup = worker_setup_json(config)
        specs = [
            RankSpec(
                rank=i,
                world_size=size,
                local_rank=i,
                local_world_size=local,
                model_dir=str(model_dir),
                device_type=device.type,
                first_device=device.index or 0,
                master_addr=config.master_addr,
                master_port=port,
                parent_pid=os.getpid(),
                threads=threads,
                setup_json=setup if i == 0 else None,
            )
            for i in range(local)
        ]
        if config.nnodes > 1:
            logger.info(
                "waiting for %d more node(s) to join at %s:%d (vlmserve worker ... --node-rank K)",
                config.nnodes - 1,
                config.master_addr,
                port,
            )
        self._beats = new_beats(local)
        self._stall_s = config.rank_stall_timeout_s
        self.processes = spawn_ranks(specs, rank0_end, self._beats)
        rank0_end.close()  # rank 0 holds it now: its death closes the pipe
        # Stopped with the engine, or when this object goes (an LLM dropped without shutdown).
        self._finalizer = weakref.finalize(self, _stop, self._conn, self.processes, True)
        self._failure = ""  # why the ranks were stopped, once they were
        self._wait_reply("starting")

    def _call(self, call: WorkerCall, what: str) -> Reply:
        if not self._finalizer.alive:
            raise ExecutorError(self._failure or "the tensor-parallel ranks were shut down")
        with contextlib.suppress(OSError):  # rank 0 is gone: the wait names it
            self._conn.send_bytes(serial.encode(call))
        return self._wait_reply(what)

    def _wait_reply(self, what: str) -> Reply:
        """Rank 0's reply, watching every local rank's process while waiting: a death, or a
        heartbeat older than the stall timeout (a stopped or hung rank blocks the others in their
        collective for ever, and rank 0's own threads would go on)."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        while True:
            ready = multiprocessing.connection.wait([self._conn, *sentinels], timeout=RANK_BEAT_S)
            if not ready:
                now = time.monotonic()
                silent = [(now - beat, rank) for rank, beat in enumerate(self._beats) if now - beat > self._stall_s]
                if silent:
                    seconds, rank = max(silent)
                    self._fail(
                        f"tensor-parallel rank {rank} has not been heard from for {seconds:.0f} s (stopped or hung) "
                        f"while {what}"
                    )
                continue
            if self._conn in ready:
                try:
                    reply: Reply = reply_decoder.decode(self._conn.recv_bytes())
                except (EOFError, OSError):  # rank 0 died without a word
                    self._rank_died(0, what)
                if reply.error is None:
                    return reply
                # Rank 0 failed (and exits): a collective with a rank that died is the usual
                # cause, and that rank is the one to name (its process is gone already).
                others = [s for s, rank in sentinels.items() if rank != 0]
                gone = multiprocessing.connection.wait(others, timeout=1.0)
                dead = [sentinels[s] for s in gone if isinstance(s, int)]
                if dead:
                    self._rank_died(min(dead), what)
                self._fail(f"{reply.error} (while {what})")
            dead = [sentinels[s] for s in ready if isinstance(s, int)]
            if dead:
                self._rank_died(min(dead), what)

    def _rank_died(self, rank: int, what: str) -> NoReturn:
        process = self.processes[rank]
        process.join(5)  # its sentinel (or pipe) may tell before its exit code is collected
        self._fail(f"tensor-parallel rank {rank} died (exit code {process.exitcode}) while {what}")

    def _fail(self, message: str) -> NoReturn:
        logger.error("%s; stopping the other ranks", message)
        self._failure = message
        if self._finalizer.detach() is not None:
            _stop(self._conn, self.processes, polite=False)
        raise ExecutorError(message)

    def plan(
        self,
        dummy_items: list[MultiModalItem] | None,
        num_tokens: int = 0,
        max_model_len: int = 0,
        num_seqs: int = 0,
        block_size: int = 0,
    ) -> list[RankInfo]:
        call = Plan(dummy_items is not None, dummy_items or [], num_tokens, max_model_len, num_seqs, block_size)
        return self._call(call, "planning memory").ranks

    def bind_caches(self, num_blocks: int, block_size: int, group_slots: list[int]) -> None:
        self._call(BindCaches(num_blocks, block_size, group_slots), "binding the caches")

    def execute(self, step: SchedulerOutput) -> StepResult:
        result = self._call(Execute(step), "executing a step").step
        assert result is not None, "rank 0 answered a step without its output"
        return result

    def free_encoder_outputs(self, content_hashes: list[str]) -> None:
        if content_hashes:
            self._call(FreeEncoderOutputs(content_hashes), "freeing encoder outputs")

    def reset(self) -> None:
        self._call(Reset(), "resetting")

    def add_lora(self, lora: LoRARequest) -> AdapterInfo:
        return _adapter_info(self._call(AddLoRA(lora), f"loading LoRA adapter {lora.lora_name!r}"))

    def remove_lora(self, lora_name: str) -> None:
        self._call(RemoveLoRA(lora_name), f"removing LoRA adapter {lora_name!r}")

    def request_digests(self) -> list[tuple[int, int]]:
        """Per rank, how many requests it holds and a digest of their token ids: all equal while
        the ranks agree."""
        flat = self._call(DigestRequests(), "comparing the ranks").digests
        return list(zip(flat[::2], flat[1::2], strict=True))

    def shutdown(self) -> None:
        """Stop every local rank (and, through rank 0, every other node's)."""
        self._finalizer()


def _stop(
    conn: multiprocessing.connection.Connection, processes: list[multiprocessing.process.BaseProcess], polite: bool
) -> None:
    """`polite`: ask the ranks to leave (ranks on other nodes exit cleanly too) before killing
    what is left of this node's."""
    if polite and all(p.is_alive() for p in processes):
        with contextlib.suppress(OSError):
            conn.send_bytes(serial.encode(Shutdown()))
            for process in processes:
                process.join(5)
    stop_ranks(processes)
    conn.close()


def make_executor(
    config: EngineConfig, model_dir: Path, device: torch.device, backend: AttentionBackend
) -> InProcessExecutor | MultiprocExecutor:
    """`backend`: the engine core's, shared in-process (each rank makes its own)."""
    if config.tensor_parallel_size == 1:
        return InProcessExecutor(config, model_dir, device, backend)
    return MultiprocExecutor(config, model_dir, device)
