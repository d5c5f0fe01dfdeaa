"""The engine process: `python -m vlmserve.engine.engine_process --config JSON --input ADDR
--output ADDR --parent PID`, started by the API process.

It connects to the API process's two ZMQ sockets, takes AddRequest / AbortRequests messages,
copies each request's pixels out of shared memory (unlinking the segments), steps the engine
core while there is work, and sends back each step's token ids plus periodic stats. A thread of
its own sends a heartbeat every HEARTBEAT_INTERVAL_S, so the API process can tell a long step from
a stopped process. It exits when told to, and by itself when the API process that started it is
gone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import threading
import time

import msgspec
import torch
import zmq

from vlmserve.engine.banner import engine_summary
from vlmserve.engine.checkpoint import load_engine_model
from vlmserve.engine.config import EngineConfig
from vlmserve.engine.core import EngineCore
from vlmserve.engine.executor import ExecutorError
from vlmserve.engine.request import RequestStatus
from vlmserve.engine.stat_logger import StatLogger
from vlmserve.ipc import shm, token_handles
from vlmserve.ipc.messages import (
    AbortRequests,
    AddLoRA,
    AddRequest,
    Heartbeat,
    ListLoRAs,
    LoRAReply,
    Ready,
    RemoveLoRA,
    RequestFailed,
    Shutdown,
    Stats,
    StepOutputs,
    encoder,
    to_engine_decoder,
)
from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.progress import LOG_DATE_FORMAT, LOG_FORMAT, exit_now

logger = logging.getLogger("vlmserve.engine")
STATS_INTERVAL_S = 0.5
HEARTBEAT_INTERVAL_S = 0.5


class HeartbeatThread(threading.Thread):
    """Sends Heartbeat(pid) to `address` every HEARTBEAT_INTERVAL_S until stopped.

    Not from the step loop: one step (a large image's encode, a long prefill on a small CPU) may
    legitimately take many seconds, and that is not a stall. What stops the heartbeat is the whole
    process stopping (SIGSTOP, a debugger, swapped out) or the interpreter held for the whole
    timeout by one call that keeps the GIL; the API process treats both as a stall (torch kernels
    release the GIL, so a long step does not). The thread has a PUSH socket of its own (ZMQ sockets
    are not thread-safe), connected to the same PULL socket as the step loop's; CONFLATE keeps
    only the latest heartbeat queued when the API process is slow to read."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.context, self.address = context, address
        self.stopped = threading.Event()

    def run(self) -> None:
        socket = self.context.socket(zmq.PUSH)
        socket.setsockopt(zmq.CONFLATE, 1)
        socket.connect(self.address)
        beat = encoder.encode(Heartbeat(os.getpid()))
        try:
            while True:
                with contextlib.suppress(zmq.Again):  # not connected yet: the next one goes
                    socket.send(beat, zmq.NOBLOCK)
                if self.stopped.wait(HEARTBEAT_INTERVAL_S):
                    return
        finally:
            socket.close(linger=0)  # before the context is terminated, which waits for every socket


class EngineLoop:
    def __init__(self, core: EngineCore, pull: zmq.Socket, push: zmq.Socket, parent_pid: int) -> None:
        self.core = core
        self.pull, self.push = pull, push
        self.parent_pid = parent_pid
        self.running = True
        self.last_stats = 0.0
        interval = float(os.environ.get("VLMSERVE_LOG_STATS_INTERVAL", "10"))
        self.stat_logger = StatLogger(core, interval, logger)
        # Engine request id -> (the API process's request id, all its samples' engine ids), so a
        # failed sample fails its whole request by the id the API process knows.
        self.parents: dict[str, tuple[str, list[str]]] = {}

    def run(self) -> None:
        summary = engine_summary(self.core, self.core.config.model)
        ready = Ready(self.core.memory_plan.describe(), self.core.max_model_len, summary, cache_config_info(self.core))
        self.push.send(encoder.encode(ready))
        while self.running:
            if os.getppid() != self.parent_pid:
                logger.warning("the API process is gone; exiting")
                return
            busy = self.core.has_unfinished_requests()
            # Idle: block briefly on the socket (and look at the parent again); busy: just drain.
            timeout_ms = 0 if busy else 200
            while self.pull.poll(timeout_ms):
                self._handle(self.pull.recv())
                timeout_ms = 0
            if self.core.has_unfinished_requests():
                self._step()
            if time.monotonic() - self.last_stats > STATS_INTERVAL_S:
                self._send_stats()
            self.stat_logger.maybe_log()

    def _step(self) -> None:
        """One engine step; a request an error in the engine failed is answered RequestFailed
        (internal; its siblings finished too) and the engine goes on."""
        outputs = self.core.step()
        timestamp = time.monotonic()
        for output in outputs:
            if output.finish_reason is not None:
                self.parents.pop(output.request_id, None)
        if outputs:
            self.push.send(encoder.encode(StepOutputs(outputs, timestamp)))
        for child_id, why in self.core.take_failed().items():
            self._fail(child_id, why, internal=True)
        self._answer_refused()

    def _answer_refused(self) -> None:
        """Requests refused for their grammar (it does not compile, or passed a limit): a 400."""
        for child_id, why in self.core.take_refused().items():
            self._fail(child_id, why, internal=False)

    def _fail(self, child_id: str, why: str, internal: bool) -> None:
        """The request of this sample fails, with all its samples."""
        if child_id not in self.parents:
            return  # a sibling's failure already answered for it
        parent, siblings = self.parents[child_id]
        self.core.finish_requests(siblings)
        for sibling in siblings:
            self.parents.pop(sibling, None)
        self.push.send(encoder.encode(RequestFailed(parent, why, internal=internal)))

    def _handle(self, raw: bytes) -> None:
        try:
            message = to_engine_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.warning("dropped a malformed message (%d bytes): %s", len(raw), e)
            return
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequests):
            status = RequestStatus.FINISHED_STOPPED if message.stopped else RequestStatus.FINISHED_ABORTED
            self.core.finish_requests(message.request_ids, status)
            for request_id in message.request_ids:
                self.parents.pop(request_id, None)
        elif isinstance(message, AddLoRA | RemoveLoRA | ListLoRAs):
            self.push.send(encoder.encode(self._lora_call(message)))
        elif isinstance(message, Shutdown):
            self.running = False

    def _lora_call(self, call: AddLoRA | RemoveLoRA | ListLoRAs) -> LoRAReply:
        """An adapter call, answered between steps. An adapter that cannot be served is the
        caller's error (its message goes back); any other error is ours, logged, and named by type."""
        try:
            if isinstance(call, AddLoRA):
                self.core.add_lora(call.lora)
                return LoRAReply(call.call_id)
            if isinstance(call, RemoveLoRA):
                return LoRAReply(call.call_id, removed=self.core.remove_lora(call.lora_name))
            return LoRAReply(call.call_id, loras=self.core.list_loras())
        except (ValueError, OSError) as e:  # LoRAError among them: a missing file, a wrong shape...
            return LoRAReply(call.call_id, error=str(e))
        except Exception as e:
            logger.exception("adapter call %s failed", type(call).__name__)
            return LoRAReply(call.call_id, error=f"the engine's adapter call raised {type(e).__name__}")

    def _add(self, message: AddRequest) -> None:
        try:
            prompt = self._prompt(message)
            self.core.check_fits(prompt)
            for child_id, params in zip(message.child_ids, message.params, strict=True):
                self.core.add_request(
                    child_id,
                    prompt,
                    params,
                    message.owner,
                    lora_request=message.lora_request,
                    pooling_params=message.pooling_params,
                )
            for child_id in message.child_ids:
                self.parents[child_id] = (message.request_id, list(message.child_ids))
            self._answer_refused()
        except (ValueError, shm.ShmError) as e:
            self.core.finish_requests(list(message.child_ids))  # any child already admitted
            self.push.send(encoder.encode(RequestFailed(message.request_id, str(e))))
        except Exception as e:  # our own error, not the request's: it fails alone
            logger.exception("adding request %s failed", message.request_id)
            self.core.finish_requests(list(message.child_ids))
            why = f"adding it raised {type(e).__name__}"
            self.push.send(encoder.encode(RequestFailed(message.request_id, why, internal=True)))

    def _prompt(self, message: AddRequest) -> ProcessedPrompt:
        """Pixels out of shared memory (segments unlinked whatever happens)."""
        prompt = message.prompt
        try:
            if len(message.segments) != len(prompt.mm_items):
                raise ValueError(f"{len(prompt.mm_items)} items but {len(message.segments)} pixel segments")
            for item, segment in zip(prompt.mm_items, message.segments, strict=True):
                item.pixel_values = torch.from_numpy(shm.read_and_unlink(segment))
        finally:
            for segment in message.segments:
                shm.unlink(segment.name)
        if not prompt.mm_items:  # The list-of-dicts input: handles may travel inside the token ids
            ids, items = token_handles.decode(prompt.prompt_token_ids, self.core.model_info.processing)
            if items:
                return self.core.model_info.processing.from_token_ids(ids, items)
        return prompt

    def _send_stats(self) -> None:
        sched = self.core.scheduler
        running_loras, waiting_loras = self.core.lora_requests_info() if self.core.config.enable_lora else ([], [])
        self.push.send(
            encoder.encode(
                Stats(
                    waiting=len(sched.waiting) + len(self.core.structured_outputs.waiting),
                    running=len(sched.running),
                    kv_cache_usage=self.core.kv.usage,
                    prefix_cache_queries=self.core.kv.prefix_queries,
                    prefix_cache_hits=self.core.kv.prefix_hits,
                    encoder_cache_hits=sched.encoder_cache.hits,
                    encoder_cache_misses=sched.encoder_cache.misses,
                    preemptions=sched.num_preemptions,
                    # each name once, as vLLM's labels list them
                    running_lora_adapters=list(dict.fromkeys(running_loras)),
                    waiting_lora_adapters=list(dict.fromkeys(waiting_loras)),
                )
            )
        )
        self.last_stats = time.monotonic()


def cache_config_info(core: EngineCore) -> dict[str, str]:
    """vLLM's vllm:cache_config_info labels (its CacheConfig's fields as str()) that mean something
    here: the KV cache's dtype follows the model's ("auto"), and there is no CPU swap space."""
    return {
        "block_size": str(core.kv.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(core.config.enable_prefix_caching),
        "num_gpu_blocks": str(core.memory_plan.num_blocks),
        "num_cpu_blocks": "None",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlmserve.engine.engine_process")
    parser.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    parser.add_argument("--input", required=True, help="ZMQ address to pull requests from")
    parser.add_argument("--output", required=True, help="ZMQ address to push outputs to")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--eos-token-ids", default="[]", help="JSON list: the ids that end generation")
    parser.add_argument("--engine-index", type=int, default=None, help="its index among data-parallel engines")
    parser.add_argument("--lora-modules", default="[]", help="JSON list of LoRARequests: the adapters loaded at start")
    parser.add_argument("--restarted", action="store_true", help="started again after a death (an adapter may fail)")
    args = parser.parse_args(argv)
    # The API process's --log-level (its environment is inherited).
    level = os.environ.get("VLMSERVE_LOG_LEVEL", "info").upper()
    name = "engine" if args.engine_index is None else f"engine {args.engine_index}"
    logging.basicConfig(level=level, format=f"[{name}] " + LOG_FORMAT, datefmt=LOG_DATE_FORMAT)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(**json.loads(args.config))
    try:
        # No tokenizer, no processor here: the API process sends token ids, positions and pixels.
        core = EngineCore(config, load_engine_model(config, json.loads(args.eos_token_ids)), log_stats=True)
    except (ValueError, OSError) as e:  # what the user can change: the checkpoint, the budget, the limits
        logger.error("the engine cannot start: %s", e, exc_info=logger.isEnabledFor(logging.DEBUG))
        return 1
    # The server's adapters: --lora-modules; for a restarted engine, those the server held when the
    # last one died (one that cannot be read now is left out: a request naming it gets the reason).
    for lora in msgspec.json.decode(args.lora_modules, type=list[LoRARequest]):
        try:
            core.add_lora(lora)
        except (ValueError, OSError) as e:  # LoRAError among them
            if args.restarted:
                logger.warning("adapter %r (%s) not loaded again: %s", lora.lora_name, lora.lora_path, e)
                continue
            logger.error("the engine cannot start: adapter %r (%s): %s", lora.lora_name, lora.lora_path, e)
            core.shutdown()
            return 1
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.connect(args.input)
    push = context.socket(zmq.PUSH)
    push.connect(args.output)
    heartbeat = HeartbeatThread(context, args.output)
    heartbeat.start()
    try:
        EngineLoop(core, pull, push, args.parent).run()
    except ExecutorError as e:  # a tensor-parallel rank died: exit, and the API process restarts the engine
        logger.error("the engine cannot go on: %s", e)
        return 1
    finally:
        core.shutdown()
        heartbeat.stopped.set()
        heartbeat.join()
        push.close(linger=1000)
        pull.close(linger=0)
        context.term()
    return 0


if __name__ == "__main__":
    exit_now(main())
