"""The API process's side of the engine, request by request: it hands the engine each request
(pixels through shared memory, the rest over ZMQ), keeps each request's queue and the segments
the engine may not have taken yet, aborts what a client leaves, and routes what the engine sends
back (detokenized) to whoever awaits it. The process itself is EngineSupervisor's.

If the engine process dies, every request in flight fails with EngineDeadError (segments not yet
taken are unlinked), and the engine is started again; new requests are refused with
EngineDeadError until it is ready. After `max_restarts` deaths the client gives up for good.
An engine not heard from for `heartbeat_timeout_s` gets no new request (EngineDeadError naming
its silence) while those in flight wait for it; silent for `stall_timeout_s`, it is killed, which
is a death as above (the supervisor's business).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from contextvars import ContextVar
from pathlib import Path

import msgspec
import torch
import zmq
import zmq.asyncio

from vlmserve.api.engine_supervisor import EngineDeadError, EngineSupervisor
from vlmserve.api.frontend import Frontend
from vlmserve.api.output_processor import OutputProcessor
from vlmserve.api.request_stats import RequestStatsTracker, StatLogger
from vlmserve.engine.config import EngineConfig
from vlmserve.ipc import shm, token_handles
from vlmserve.ipc.contracts import EngineCoreOutput
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
    from_engine_decoder,
)
from vlmserve.lora.request import LoRAError, LoRARequest
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from vlmserve.pooling import PoolingParams
from vlmserve.sampling_params import SamplingParams

# The HTTP request being served, set by its endpoint: the engine shares its steps fairly among
# these (its prompts, samples and beams are one owner). None: each request is its own owner.
# NOTE: a context variable, as serving.request_arrival, so that beam search and the data-parallel
# router pass it on untouched.
request_owner: ContextVar[str | None] = ContextVar("request_owner", default=None)
# The adapter the request being served runs with (its `model` named one), set by its endpoint;
# None: the base model. A context variable for the same reason.
request_lora: ContextVar[LoRARequest | None] = ContextVar("request_lora", default=None)

logger = logging.getLogger("vlmserve.api")

# What an item carries on the socket in place of its pixels (they travel in shared memory).
_NO_PIXELS = torch.empty(0)


class RequestRefused(ValueError):
    """The engine refused the request; the message says why (e.g. it can never fit)."""


class RequestFailedInEngine(RuntimeError):
    """An error in the engine failed the request (the engine went on); the message, for the
    log only, says where."""


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        frontend: Frontend,
        *,
        threads: int = 0,
        max_restarts: int = 3,
        heartbeat_timeout_s: float = 10.0,
        stall_timeout_s: float = 60.0,
        stat_logger: StatLogger | None = None,
        index: int | None = None,
    ) -> None:
        """`stat_logger`: where each engine message's per-request timings go (the metrics);
        `index`: the engine's among data-parallel engines (dp_client.py; None: the only one)."""
        self.config = config
        self.frontend = frontend
        self.outputs = OutputProcessor(frontend.tokenizer)
        self.queues: dict[str, asyncio.Queue[RequestOutput | EngineCoreOutput | BaseException]] = {}
        self.pooling: set[str] = set()  # the pooling requests in flight (no output processor state)
        self.segments: dict[str, list[str]] = {}  # request id -> segments the engine may not have taken yet
        self.stats: Stats | None = None  # the running engine's latest; None while none runs
        self.stat_logger = stat_logger
        self.request_stats = RequestStatsTracker()
        # 0700: only this user reaches the sockets; the pid in the name says whose it is.
        self._dir = Path(tempfile.mkdtemp(prefix=f"vlmserve-ipc-{os.getpid()}-"))
        self._context = zmq.asyncio.Context()
        self._push = self._context.socket(zmq.PUSH)
        self._push.bind(f"ipc://{self._dir}/to-engine")
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(f"ipc://{self._dir}/from-engine")
        self.engine = EngineSupervisor(
            config,
            f"ipc://{self._dir}/to-engine",
            f"ipc://{self._dir}/from-engine",
            eos_token_ids=sorted(frontend.eos_token_ids),
            threads=threads,
            max_restarts=max_restarts,
            heartbeat_timeout_s=heartbeat_timeout_s,
            stall_timeout_s=stall_timeout_s,
            index=index,
        )
        self._reader: asyncio.Task[None] | None = None
        # Adapter calls awaiting the engine's LoRAReply, by call id.
        self._lora_calls: dict[int, asyncio.Future[LoRAReply]] = {}
        self._call_ids = itertools.count(1)

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self, timeout_s: float = 600.0) -> None:
        swept = shm.sweep()
        if swept:
            logger.warning("removed %d shared-memory segments left by a crashed run", len(swept))
        self.engine.spawn()
        self._reader = asyncio.create_task(self._read_loop())
        await self.engine.wait_ready(timeout_s)

    async def shutdown(self) -> None:
        if self.engine.running:
            if self.engine.ready.is_set():
                await self._push.send(encoder.encode(Shutdown()))
                await self.engine.join(10)
            else:
                # Still loading: not connected to the sockets yet (a send would wait for it for ever:
                # with data-parallel engines, another one's failure to start stops this one).
                await self.engine.join(0)
        if self._reader is not None:
            self._reader.cancel()
        for call in self._lora_calls.values():
            call.cancel()
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)  # the two socket files
        for names in self.segments.values():
            for name in names:
                shm.unlink(name)

    @property
    def unavailable_reason(self) -> str | None:
        """Why a new request would be refused now (engine not running, or silent); None if not."""
        return self.engine.unavailable_reason

    # -- requests ---------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, arrival_time: float | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request; yields its (cumulative) output after every step that changed it.
        Closing the iterator early (client gone) aborts the request and frees what it holds.
        `arrival_time`: when the request arrived (time.monotonic()), for its metrics; None: now."""

        def message(wire_prompt: ProcessedPrompt, segments: list[shm.Segment]) -> AddRequest:
            child_ids = self.outputs.add_prompt(request_id, prompt, params)
            room = self.frontend.max_model_len - prompt.num_tokens
            max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
            arrival = time.monotonic() if arrival_time is None else arrival_time
            self.request_stats.add(request_id, child_ids, prompt.num_tokens, max_tokens, arrival)
            children = [params.for_child(i) for i in range(len(child_ids))]
            owner = request_owner.get() or request_id
            return AddRequest(request_id, child_ids, children, wire_prompt, segments, owner, request_lora.get())

        async with aclosing(self._submit(request_id, prompt, message)) as outputs:
            async for output in outputs:
                assert isinstance(output, RequestOutput)
                yield output

    async def pool(self, request_id: str, prompt: ProcessedPrompt, params: PoolingParams) -> PoolingRequestOutput:
        """A pooling model's request: its prompt's vector (an embedding, or a reranker's score),
        straight from the engine's output (no detokenizer). Cancelling the call aborts it."""

        def message(wire_prompt: ProcessedPrompt, segments: list[shm.Segment]) -> AddRequest:
            self.pooling.add(request_id)
            owner = request_owner.get() or request_id
            no_sampling = [SamplingParams(max_tokens=1)]
            return AddRequest(
                request_id, [request_id], no_sampling, wire_prompt, segments, owner, request_lora.get(), params
            )

        try:
            async with aclosing(self._submit(request_id, prompt, message)) as outputs:
                async for output in outputs:
                    assert isinstance(output, EngineCoreOutput) and output.pooled is not None
                    pooled = PoolingOutput(output.pooled)
                    return PoolingRequestOutput(
                        request_id, pooled, list(prompt.prompt_token_ids), True, output.num_cached_tokens
                    )
        finally:
            self.pooling.discard(request_id)
        raise AssertionError("a pooling request ends with its output or an error")

    async def _submit(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        message: Callable[[ProcessedPrompt, list[shm.Segment]], AddRequest],
    ) -> AsyncGenerator[RequestOutput | EngineCoreOutput, None]:
        """The engine request `message` makes of the prompt as it travels (pixels left out: they
        wait in the segments), sent; yields what comes back for it until it is finished (a
        pooling request's one output). Closing early aborts it; segments the engine never took
        are unlinked."""
        # The list-of-dicts input: segments named by handles in the ids are ours to free until the engine has them.
        names = [] if prompt.mm_items else token_handles.segment_names(prompt.prompt_token_ids, self.frontend.processor)
        reason = self.unavailable_reason
        if reason is not None or request_id in self.queues:
            for name in names:
                shm.unlink(name)
            if reason is not None:
                raise EngineDeadError(reason)
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | EngineCoreOutput | BaseException] = asyncio.Queue()
        self.queues[request_id] = queue
        self.segments[request_id] = names
        finished = False
        submitted = False
        try:
            segments = []
            for item in prompt.mm_items:
                segments.append(shm.write_array(item.pixel_values.numpy()))
                names.append(segments[-1].name)
            # The prompt as processed, its pixels left out: they wait in the segments.
            wire_prompt = dataclasses.replace(
                prompt,
                prompt=None,
                mm_items=[dataclasses.replace(item, pixel_values=_NO_PIXELS) for item in prompt.mm_items],
            )
            add = message(wire_prompt, segments)
            submitted = True
            await self._push.send(encoder.encode(add))
            while True:
                output = await queue.get()
                if isinstance(output, BaseException):
                    finished = True
                    raise output
                finished = isinstance(output, EngineCoreOutput) or output.finished
                yield output
                if finished:
                    return
        finally:
            self.queues.pop(request_id, None)
            self.request_stats.forget(request_id)  # a request that finished is gone already
            if submitted and not finished:
                await self.abort(request_id)
            # The engine unlinks segments it took; any it never took go here.
            for name in self.segments.pop(request_id, []):
                shm.unlink(name)

    async def abort(self, request_id: str) -> None:
        if request_id in self.pooling:
            child_ids = [request_id]
        else:
            _, child_ids = self.outputs.abort(request_id)
        # Queued for an engine that is only silent: it drops the request if it comes back.
        if child_ids and self.engine.healthy:
            await self._push.send(encoder.encode(AbortRequests(child_ids)))

    # -- adapters ---------------------------------------------------------------------------------

    async def add_lora(self, lora: LoRARequest) -> None:
        """Load an adapter into the engine (a restarted engine loads it again); LoRAError naming
        what is wrong when it cannot be served, EngineDeadError when the engine is down."""
        reply = await self._lora_call(AddLoRA(next(self._call_ids), lora))
        if reply.error:
            raise LoRAError(reply.error)
        self.engine.loras[lora.lora_name] = lora

    async def remove_lora(self, lora_name: str) -> bool:
        """Drop an adapter from the engine; False where it held none of that name."""
        self.engine.loras.pop(lora_name, None)
        reply = await self._lora_call(RemoveLoRA(next(self._call_ids), lora_name))
        if reply.error:
            raise LoRAError(reply.error)
        return reply.removed

    async def list_loras(self) -> list[LoRARequest]:
        """The adapters the engine holds, in load order."""
        reply = await self._lora_call(ListLoRAs(next(self._call_ids)))
        return reply.loras

    async def _lora_call(self, message: AddLoRA | RemoveLoRA | ListLoRAs) -> LoRAReply:
        reason = self.unavailable_reason
        if reason is not None:
            raise EngineDeadError(reason)
        reply: asyncio.Future[LoRAReply] = asyncio.get_running_loop().create_future()
        self._lora_calls[message.call_id] = reply
        try:
            await self._push.send(encoder.encode(message))
            return await reply
        finally:
            self._lora_calls.pop(message.call_id, None)

    # -- engine output ----------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        while True:
            try:
                if await self._pull.poll(500):
                    self._dispatch(await self._pull.recv())
                else:
                    # Only with the socket drained: an API process that was held up itself reads
                    # the heartbeats waiting for it before it judges the engine.
                    self.engine.kill_if_stalled()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("dropped an engine message")
            if self.engine.exited:
                await self._engine_died()

    def _dispatch(self, raw: bytes) -> None:
        try:
            message = from_engine_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.warning("dropped a malformed engine message: %s", e)
            return
        if isinstance(message, StepOutputs):
            generated = message.outputs
            if self.pooling:  # a pooling request's output is its vector, for whoever awaits it
                for pooled in [o for o in generated if o.pooled is not None]:
                    self.segments.pop(pooled.request_id, None)  # the engine took them
                    pooling_queue = self.queues.get(pooled.request_id)
                    if pooling_queue is not None:
                        pooling_queue.put_nowait(pooled)
                generated = [o for o in generated if o.pooled is None]
            outputs, stopped = self.outputs.process(generated)
            if stopped:
                self._push.send(encoder.encode(AbortRequests(stopped, stopped=True)))
            now = time.monotonic()
            for output in outputs:
                self.segments.pop(output.request_id, None)  # the engine took them
                queue = self.queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
            stats = self.request_stats.update(message.timestamp, message.outputs, outputs, now)
            if self.stat_logger is not None:
                self.stat_logger.record(stats)
        elif isinstance(message, RequestFailed):
            self.outputs.abort(message.request_id)
            self.segments.pop(message.request_id, None)  # the engine released them
            queue = self.queues.get(message.request_id)
            if queue is not None:
                error = RequestFailedInEngine if message.internal else RequestRefused
                queue.put_nowait(error(message.message))
        elif isinstance(message, Stats):
            if self.engine.ready.is_set():  # not the last words of a dead engine, read after its death
                self.stats = message
        elif isinstance(message, LoRAReply):
            call = self._lora_calls.get(message.call_id)
            if call is not None and not call.done():
                call.set_result(message)
        elif isinstance(message, Heartbeat):
            self.engine.heartbeat(message.pid)
        elif isinstance(message, Ready):
            self.engine.mark_ready(message.memory_plan, message.summary)
            if self.stat_logger is not None:
                self.stat_logger.log_engine_initialized(message.cache_config)

    async def _engine_died(self) -> None:
        what = self.engine.died()
        if not self.engine.was_ready:
            # It never started (a bad checkpoint, too small a budget): starting it again would
            # fail the same way; start() reports it.
            raise asyncio.CancelledError
        self.stats = None  # its numbers describe nothing now; the next engine reports its own
        for request_id, queue in list(self.queues.items()):
            self.outputs.abort(request_id)
            queue.put_nowait(EngineDeadError(f"{self.engine.name} process {what} while serving this request"))
        for call in self._lora_calls.values():
            if not call.done():
                call.set_exception(EngineDeadError(f"{self.engine.name} process {what} before it answered"))
        for names in self.segments.values():
            for name in names:
                shm.unlink(name)
        self.segments.clear()
        if not self.engine.restart():
            raise asyncio.CancelledError
