"""One tensor-parallel rank: the model (its shard, once the layers shard themselves under the
group) and a ModelRunner, serving the calls the engine core makes on its executor.

In-process (tensor_parallel_size 1) the executor calls a Worker's methods directly. In a rank's
own process (`worker_main`) the calls arrive as msgspec messages: rank 0 reads them from the
engine core's pipe and broadcasts the bytes to the other ranks (distributed/control.py), every
rank handles them, and rank 0 answers. Ranks of another machine are started by `vlmserve worker`
(`run_node`) and join the same env:// rendezvous."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import torch

from vlmserve.attention import AttentionBackend, select_backend
from vlmserve.distributed import destroy_tensor_parallel, init_tensor_parallel, tp_group
from vlmserve.distributed.control import MESSAGE, GroupFailed, broadcast_bytes
from vlmserve.engine.checkpoint import open_checkpoint, resolve_max_model_len, resolve_pooler
from vlmserve.engine.config import EngineConfig, resolve_dtype
from vlmserve.engine.memory import default_budget
from vlmserve.engine.model_runner import ModelRunner
from vlmserve.engine.pooler import Pooler, score_token_ids
from vlmserve.engine.step_isolation import execute_or_isolate
from vlmserve.ipc import serial
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
    WorkerCall,
    call_decoder,
)
from vlmserve.lora.manager import LoRAManager
from vlmserve.lora.request import LoRAError, LoRARequest
from vlmserve.models.build import build_model
from vlmserve.progress import LOG_DATE_FORMAT, LOG_FORMAT

logger = logging.getLogger(__name__)

# A rank waits for the next step as long as the engine is idle: no timeout on its collectives
# short of that (a dead peer is seen by the engine core's process watch, or by gloo's closed
# connection, at once).
COLLECTIVE_TIMEOUT_S = 30 * 24 * 3600.0
# How often a rank's heartbeat thread says it is alive (new_beats, MultiprocExecutor._wait_reply).
RANK_BEAT_S = 0.5

# -- one rank --------------------------------------------------------------------------------------


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        device: torch.device,
        backend: AttentionBackend | None = None,
        local_world_size: int = 1,
    ) -> None:
        """`backend`: the engine core's, shared in-process; a rank process makes its own.
        `local_world_size`: ranks on this host (on the CPU they share its memory)."""
        self.config = config
        self.device = device
        self.local_world_size = local_world_size
        _, model_config, family, _ = open_checkpoint(config, model_dir)
        pooler = resolve_pooler(config, model_dir, model_config)
        self.dtype = resolve_dtype(config.dtype, model_config.checkpoint_dtype, device)
        max_model_len = resolve_max_model_len(config, model_config)
        # The batched-decode workspace bounds a step's transient memory; the plan measures it.
        workspace = max_model_len
        self.backend = backend or select_backend(device, config.attention_backend, decode_workspace_tokens=workspace)
        draft_head = (config.speculative_config or {}).get("method") == "mtp"
        poolers: list[Pooler] = []
        tokens = None
        if pooler is not None and pooler.score_tokens is not None:
            tokens = score_token_ids(model_dir, family.load_tokenizer, pooler.score_tokens)
        self.model = build_model(
            family.model_class,
            model_config,
            model_dir,
            self.backend,
            device,
            self.dtype,
            config.quantization,
            draft_head=draft_head,
            # An embedding model reads no lm_head (its checkpoint may have none); a reranker its
            # two rows, which its pooler takes as they were loaded (then drops the rest).
            lm_head=pooler is None or pooler.needs_lm_head,
            on_loaded=None if pooler is None else lambda model: poolers.append(Pooler(pooler, model, tokens)),
        )
        self.runner = ModelRunner(self.model, device, self.dtype)
        self.runner.pooler = poolers[0] if poolers else None
        if config.enable_lora:
            self.runner.lora = LoRAManager(
                self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, device, self.dtype
            )

    def plan(self, call: Plan) -> RankInfo:
        info = RankInfo(
            # With LoRA: the adapters it may hold at once, planned as weights.
            weights_bytes=sum(p.numel() * p.element_size() for p in self.model.parameters())
            + (self.runner.lora.reserved_bytes() if self.runner.lora is not None else 0),
            kv_bytes_per_token=self.runner.kv_bytes_per_token,
            slot_bytes=self.runner.state_bytes_per_slot,
            budget_bytes=0,
        )
        if call.profile:
            info.activation_bytes = self.runner.profile_run(
                call.dummy_items, call.num_tokens, call.max_model_len, call.num_seqs, call.block_size
            )
            info.budget_bytes = self._default_budget()
        return info

    def _default_budget(self) -> int:
        budget = default_budget(self.device, self.config.gpu_memory_utilization)
        # The CPU's memory is the host's, shared by its ranks.
        return budget // self.local_world_size if self.device.type == "cpu" else budget

    def handle(self, call: WorkerCall) -> Reply:
        """Run one call on this rank; rank 0's reply gathers every rank's RankInfo for Plan."""
        runner = self.runner
        if isinstance(call, Execute):
            return Reply(step=execute_or_isolate(runner, call.step))
        if isinstance(call, Plan):
            return Reply(ranks=gather_rank_infos(self.plan(call)))
        if isinstance(call, DigestRequests):
            return Reply(digests=gather_ints(*self.digest_requests()))
        if isinstance(call, AddLoRA):
            return self.add_lora(call.lora)
        if isinstance(call, RemoveLoRA):
            if runner.lora is not None:
                runner.lora.remove(call.lora_name)
        elif isinstance(call, BindCaches):
            runner.bind_caches(call.num_blocks, call.block_size, call.group_slots)
        elif isinstance(call, FreeEncoderOutputs):
            runner.free_encoder_outputs(call.content_hashes)
        elif isinstance(call, Reset):
            runner.reset()
        return Reply()

    def add_lora(self, lora: LoRARequest) -> Reply:
        if self.runner.lora is None:
            return Reply(
                lora_error=f"adapter {lora.lora_name!r}: LoRA adapters are off; "
                "start the engine with enable_lora=True (--enable-lora)"
            )
        try:
            return Reply(lora=self.runner.lora.add(lora))
        except LoRAError as error:
            return Reply(lora_error=str(error))

    def digest_requests(self) -> tuple[int, int]:
        """How many requests this rank holds, and a digest of their ids and token ids."""
        held = sorted((r.request_id, r.token_ids) for r in self.runner.requests.values())
        return len(held), int.from_bytes(hashlib.sha256(msgspec.msgpack.encode(held)).digest()[:7], "little")


def gather_ints(*values: int) -> list[int]:
    """Every rank's `values`, rank 0's first (on every rank): a flat list, rank by rank."""
    group = tp_group()
    row = torch.tensor(values, dtype=torch.int64)
    if group.size == 1:
        return row.tolist()
    rows = [torch.empty_like(row) for _ in range(group.size)]
    torch.distributed.all_gather(rows, row, group=group.cpu_group)
    return torch.cat(rows).tolist()


def gather_rank_infos(info: RankInfo) -> list[RankInfo]:
    """Every rank's info, rank 0 first (on every rank)."""
    fields = (info.weights_bytes, info.kv_bytes_per_token, info.slot_bytes, info.budget_bytes)
    flat = gather_ints(*fields, info.activation_bytes)
    n = len(fields) + 1
    return [RankInfo(*flat[i : i + n]) for i in range(0, len(flat), n)]


# -- a rank's process ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What a rank process is started with (pickled once, at spawn; the per-step messages are
    msgspec)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    model_dir: str
    device_type: str  # "cpu" or "cuda": the group's backend, known before rank 0 says the rest
    first_device: int  # CUDA: local rank i runs on cuda:(first_device + i) (data-parallel engines' ranks differ)
    master_addr: str
    master_port: int
    parent_pid: int  # the rank exits when this process is gone (0: no watch)
    threads: int
    # Rank 0: the engine's config (worker_setup_json); the others get it from rank 0.
    setup_json: str | None


def worker_setup_json(config: EngineConfig) -> str:
    """What every rank builds from: the engine's config (media limits are the front end's)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "media_limits"}
    return json.dumps({"config": fields})


def _watch_parent(parent_pid: int) -> None:
    """Exit when the process that started this rank is gone (no orphan ranks)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            threading.Event().wait(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def rank_device(device_type: str, local_rank: int, first_device: int = 0) -> torch.device:
    return torch.device("cuda", first_device + local_rank) if device_type == "cuda" else torch.device("cpu")


def new_beats(count: int) -> Any:
    """The shared heartbeat slots of `count` local ranks, each set to now (a rank still starting
    has not been silent)."""
    beats = multiprocessing.get_context("spawn").Array("d", count, lock=False)
    beats[:] = [time.monotonic()] * count
    return beats


def _beat(beats: Any, local_rank: int) -> None:
    """Write this rank's heartbeat from a thread of its own: only a process that is stopped (or
    a call holding the GIL throughout) silences it, not a long step or a collective's wait.
    CLOCK_MONOTONIC is the machine's, so the engine compares it with its own."""

    def beat() -> None:
        while True:
            beats[local_rank] = time.monotonic()
            time.sleep(RANK_BEAT_S)

    threading.Thread(target=beat, name="rank-heartbeat", daemon=True).start()


def worker_main(spec: RankSpec, conn: multiprocessing.connection.Connection | None, beats: Any = None) -> NoReturn:
    """A rank's process: join the group, build the model, then serve calls until Shutdown.
    Rank 0 reads them from `conn` (the engine core's end of the pipe) and answers there."""
    if spec.parent_pid:
        _watch_parent(spec.parent_pid)
    if beats is not None:
        _beat(beats, spec.local_rank)
    logging.basicConfig(
        level=os.environ.get("VLMSERVE_LOG_LEVEL", "info").upper(),
        format=f"[rank {spec.rank}] " + LOG_FORMAT,
        datefmt=LOG_DATE_FORMAT,
    )
    if spec.threads:
        torch.set_num_threads(spec.threads)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = spec.master_addr, str(spec.master_port)
    device = rank_device(spec.device_type, spec.local_rank, spec.first_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_tensor_parallel(spec.rank, spec.world_size, device, "env://", timeout_s=COLLECTIVE_TIMEOUT_S)
    try:
        # Ranks on other machines load the model from their own path; the rest is rank 0's.
        setup = json.loads(broadcast_bytes(spec.setup_json.encode() if spec.setup_json is not None else None, MESSAGE))
        config = dataclasses.replace(EngineConfig(**setup["config"]), model=spec.model_dir)
        worker = Worker(config, Path(spec.model_dir), device, None, spec.local_world_size)
        if conn is not None:
            conn.send_bytes(serial.encode(Reply()))  # ready
        _serve(worker, conn)
    except (Exception, GroupFailed) as e:
        logger.exception("rank %d failed outside any one request", spec.rank)
        if conn is not None:
            error = f"tensor-parallel rank {spec.rank} failed: {type(e).__name__}: {e}"
            with contextlib.suppress(OSError):
                conn.send_bytes(serial.encode(Reply(error=error)))
        os._exit(1)  # the engine core sees it and stops the other ranks
    with contextlib.suppress(Exception):  # the other ranks are leaving too
        destroy_tensor_parallel()
    # The rank's process ends here, without the interpreter's finalization: where the group could
    # not be torn down (node 0 already gone), gloo's threads are still alive then and their C++
    # destructors abort the process ("terminate called without an active exception", SIGABRT),
    # turning a clean shutdown into a failed exit (seen once in CI: `vlmserve worker` exited -6
    # after its tokens were right). worker_main always runs in a process of its own: a spawned
    # rank, or `vlmserve worker` itself.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _serve(worker: Worker, conn: multiprocessing.connection.Connection | None) -> None:
    while True:
        raw = broadcast_bytes(conn.recv_bytes() if conn is not None else None, MESSAGE)
        call: Any = call_decoder.decode(raw)
        if isinstance(call, Shutdown):
            return
        reply = worker.handle(call)
        if conn is not None:
            conn.send_bytes(serial.encode(reply))


def spawn_ranks(
    specs: list[RankSpec], rank0_conn: multiprocessing.connection.Connection | None, beats: Any = None
) -> list[multiprocessing.process.BaseProcess]:
    """Start one process per rank (spawn: a fresh interpreter, no state forked from this one).
    `beats`: a shared array of doubles, one per local rank, where each rank's heartbeat thread
    writes time.monotonic() every RANK_BEAT_S (new_beats makes it)."""
    context = multiprocessing.get_context("spawn")
    processes: list[multiprocessing.process.BaseProcess] = []
    for spec in specs:
        process = context.Process(
            target=worker_main,
            args=(spec, rank0_conn if spec.rank == 0 else None, beats),
            name=f"vlmserve-rank-{spec.rank}",
            daemon=True,
        )
        process.start()
        processes.append(process)
    return processes


def stop_ranks(processes: list[multiprocessing.process.BaseProcess]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(5)


def run_node(
    model_dir: str,
    tensor_parallel_size: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    device_type: str,
) -> int:
    """`vlmserve worker`: this machine's ranks of an engine whose core runs on node 0. Returns
    when they end (the engine shut down, or a rank died: the others are stopped then); with one
    rank here, this process is that rank and exits with it (worker_main)."""
    local = tensor_parallel_size // nnodes
    threads = max(1, torch.get_num_threads() // local)
    specs = [
        RankSpec(
            rank=node_rank * local + i,
            world_size=tensor_parallel_size,
            local_rank=i,
            local_world_size=local,
            model_dir=model_dir,
            device_type=device_type,
            first_device=0,
            master_addr=master_addr,
            master_port=master_port,
            parent_pid=os.getpid(),
            threads=threads,
            setup_json=None,
        )
        for i in range(local)
    ]
    if local == 1:  # this process is the rank (one interpreter fewer to start), and ends with it
        worker_main(dataclasses.replace(specs[0], parent_pid=0), None)
    processes = spawn_ranks(specs, None)
    try:
        pending = {p.sentinel: p for p in processes}
        while pending:
            for sentinel in multiprocessing.connection.wait(list(pending)):
                process = pending.pop(sentinel)  # type: ignore[arg-type]
                process.join()  # its sentinel may fire before its exit code is collected
                if process.exitcode != 0:
                    logger.error("%s exited with code %s; stopping this node's ranks", process.name, process.exitcode)
                    return 1
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        stop_ranks(processes)
