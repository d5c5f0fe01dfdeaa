"""The API process's side of the engine: it starts the engine process, hands it requests (pixels
through shared memory, the rest over ZMQ), detokenizes what comes back, and streams each
request's outputs to whoever awaits them.

If the engine process dies, every request in flight fails with EngineDeadError (segments not yet
taken are unlinked), and the engine is started again; new requests are refused with
EngineDeadError until it is ready. After `max_restarts` deaths the client gives up for good.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncGenerator
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from vlmserve.engine.config import EngineConfig
from vlmserve.engine.core import EngineCoreOutput
from vlmserve.engine.frontend import Frontend
from vlmserve.engine.output_processor import OutputProcessor
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import MultiModalItemInfo, RequestOutput
from vlmserve.sampling_params import SamplingParams
from vlmserve.serve import shm
from vlmserve.serve.messages import (
    AbortRequests,
    AddRequest,
    ItemSpec,
    Ready,
    RequestFailed,
    SamplingSpec,
    Shutdown,
    Stats,
    StepOutputs,
    encoder,
    from_engine_decoder,
)

logger = logging.getLogger("vlmserve.api")


class EngineDeadError(RuntimeError):
    """The engine process is not running (it died, or is still starting)."""


class RequestRefused(ValueError):
    """The engine refused the request; the message says why (e.g. it can never fit)."""


def _engine_config_json(config: EngineConfig) -> str:
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "media_limits"}
    return json.dumps(fields)


class EngineClient:
    def __init__(self, config: EngineConfig, frontend: Frontend, *, threads: int = 0, max_restarts: int = 3) -> None:
        self.config = config
        self.frontend = frontend
        self.threads = threads
        self.max_restarts = max_restarts
        self.restarts = 0
        self.output_processor = OutputProcessor(frontend.tokenizer)
        self.queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self.segments: dict[str, list[str]] = {}  # request id -> segments the engine may not have taken yet
        self.stats: Stats | None = None  # the running engine's latest; None while none runs
        self.ready = asyncio.Event()
        self.memory_plan = ""
        self._dir = Path(tempfile.mkdtemp(prefix="vlmserve-ipc-"))  # 0700: only this user reaches the sockets
        self._context = zmq.asyncio.Context()
        self._push = self._context.socket(zmq.PUSH)
        self._push.bind(f"ipc://{self._dir}/to-engine")
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(f"ipc://{self._dir}/from-engine")
        self._process: subprocess.Popen[bytes] | None = None
        self._reader: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self, timeout_s: float = 600.0) -> None:
        swept = shm.sweep()
        if swept:
            logger.warning("removed %d shared-memory segments left by a crashed run", len(swept))
        self._spawn()
        self._reader = asyncio.create_task(self._read_loop())
        try:
            await asyncio.wait_for(self.ready.wait(), timeout_s)
        except TimeoutError:
            raise EngineDeadError(f"the engine process did not become ready within {timeout_s:.0f}s") from None

    def _spawn(self) -> None:
        command = [
            sys.executable,
            "-m",
            "vlmserve.serve.engine_process",
            "--config",
            _engine_config_json(self.config),
            "--input",
            f"ipc://{self._dir}/to-engine",
            "--output",
            f"ipc://{self._dir}/from-engine",
            "--parent",
            str(os.getpid()),
            "--threads",
            str(self.threads),
        ]
        self.ready.clear()
        self._process = subprocess.Popen(command)

    async def shutdown(self) -> None:
        if self._process is not None and self._process.poll() is None:
            await self._push.send(encoder.encode(Shutdown()))
            try:
                await asyncio.wait_for(asyncio.to_thread(self._process.wait), 10)
            except TimeoutError:
                self._process.kill()
        if self._reader is not None:
            self._reader.cancel()
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._context.term()
        for names in self.segments.values():
            for name in names:
                shm.unlink(name)

    @property
    def healthy(self) -> bool:
        return self.ready.is_set() and self._process is not None and self._process.poll() is None

    @property
    def engine_pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # -- requests ---------------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request; yields its (cumulative) output after every step that changed it.
        Closing the iterator early (client gone) aborts the request and frees what it holds."""
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        if request_id in self.queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.queues[request_id] = queue
        names: list[str] = []
        self.segments[request_id] = names
        finished = False
        submitted = False
        try:
            segments = []
            for item in prompt.mm_items:
                segments.append(shm.write_array(item.pixel_values.numpy()))
                names.append(segments[-1].name)
            items = [
                ItemSpec(
                    item.offset,
                    item.length,
                    item.grid_thw,
                    item.content_hash,
                    seg.name,
                    seg.shape,
                    item.original_size,
                    item.resized_size,
                    seg.dtype,
                    item.modality,
                    item.second_per_grid_t,
                )
                for item, seg in zip(prompt.mm_items, segments, strict=True)
            ]
            child_ids = self.output_processor.add_request(
                request_id,
                prompt.prompt,
                prompt.prompt_token_ids,
                params,
                [MultiModalItemInfo.from_item(item) for item in prompt.mm_items],
            )
            submitted = True
            specs = [self._spec(params.for_child(i)) for i in range(len(child_ids))]
            await self._push.send(
                encoder.encode(AddRequest(request_id, child_ids, specs, prompt.prompt_token_ids, items))
            )
            while True:
                output = await queue.get()
                if isinstance(output, BaseException):
                    finished = True
                    raise output
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            self.queues.pop(request_id, None)
            if submitted and not finished:
                await self.abort(request_id)
            # The engine unlinks segments it took; any it never took go here.
            for name in self.segments.pop(request_id, []):
                shm.unlink(name)

    @staticmethod
    def _spec(params: SamplingParams) -> SamplingSpec:
        return SamplingSpec(
            params.temperature,
            params.top_p,
            params.top_k,
            params.max_tokens,
            params.seed,
            list(params.stop_token_ids or []),
            params.ignore_eos,
            params.logprobs,
        )

    async def abort(self, request_id: str) -> None:
        _, child_ids = self.output_processor.abort(request_id)
        if child_ids and self.healthy:
            await self._push.send(encoder.encode(AbortRequests(child_ids)))

    # -- engine output ----------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        while True:
            try:
                if await self._pull.poll(500):
                    self._dispatch(await self._pull.recv())
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("dropped an engine message")
            if self._process is not None and self._process.poll() is not None:
                await self._engine_died()

    def _dispatch(self, raw: bytes) -> None:
        try:
            message = from_engine_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.warning("dropped a malformed engine message: %s", e)
            return
        if isinstance(message, StepOutputs):
            updates = [
                EngineCoreOutput(
                    o.request_id,
                    list(o.new_token_ids),
                    o.finish_reason,
                    o.stop_reason,
                    o.num_cached_tokens,
                    None if o.logprobs is None else [(lp, rank, list(top)) for lp, rank, top in o.logprobs],
                )
                for o in message.outputs
            ]
            outputs, stopped = self.output_processor.process(updates)
            if stopped:
                self._push.send(encoder.encode(AbortRequests(stopped, stopped=True)))
            for output in outputs:
                self.segments.pop(output.request_id, None)  # the engine took them
                queue = self.queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
        elif isinstance(message, RequestFailed):
            self.output_processor.abort(message.request_id)
            self.segments.pop(message.request_id, None)  # the engine released them
            queue = self.queues.get(message.request_id)
            if queue is not None:
                queue.put_nowait(RequestRefused(message.message))
        elif isinstance(message, Stats):
            if self.ready.is_set():  # not the last words of a dead engine, read after its death
                self.stats = message
        elif isinstance(message, Ready):
            self.memory_plan = message.memory_plan
            self.ready.set()
            logger.info("engine ready (pid %s): %s", self.engine_pid, message.memory_plan)

    async def _engine_died(self) -> None:
        code = self._process.returncode if self._process else None
        logger.error("the engine process exited (code %s)", code)
        self.ready.clear()
        self.stats = None  # its numbers describe nothing now; the next engine reports its own
        for request_id, queue in list(self.queues.items()):
            self.output_processor.abort(request_id)
            queue.put_nowait(EngineDeadError("the engine process died while serving this request"))
        for names in self.segments.values():
            for name in names:
                shm.unlink(name)
        self.segments.clear()
        if self.restarts >= self.max_restarts:
            self._process = None
            logger.error("the engine died %d times; not restarting it", self.restarts + 1)
            raise asyncio.CancelledError
        self.restarts += 1
        logger.warning("restarting the engine (restart %d of %d)", self.restarts, self.max_restarts)
        self._spawn()
