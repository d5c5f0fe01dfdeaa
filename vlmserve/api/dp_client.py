"""The API process's engines: `vlmserve serve --data-parallel-size N` runs N engine processes,
each with its own model, KV cache and prefix cache, behind one API process (vLLM's data
parallelism; N=1 is the plain server). Each engine is an EngineClient of its own (its sockets,
its supervisor: a dead engine is restarted alone, up to --max-engine-restarts, its requests in
flight fail as with one engine, and the others serve on); each request goes to the engine
dp_router.py picks among those up.

What each engine gets (engine_configs): on CUDA engine k runs on device cuda:k (with tensor
parallelism, its ranks on cuda:k*tp and the tp - 1 after it). On the CPU the N engines share the
machine: the default memory budget (half the available RAM) is split N ways,
and without --engine-threads each engine gets an equal share of torch's threads. An explicit
--memory-budget-gib or --kv-cache-memory-gib is each engine's, as vLLM's memory settings are each
device's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing

import torch

from vlmserve.api.dp_router import DataParallelRouter, affinity_keys
from vlmserve.api.engine_client import EngineClient
from vlmserve.api.engine_supervisor import EngineDeadError
from vlmserve.api.frontend import Frontend
from vlmserve.api.metrics import Metrics
from vlmserve.engine.config import EngineConfig, resolve_device
from vlmserve.engine.memory import default_budget
from vlmserve.errors import UserError
from vlmserve.lora.request import LoRAError, LoRARequest
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import PoolingRequestOutput, RequestOutput
from vlmserve.pooling import PoolingParams
from vlmserve.sampling_params import SamplingParams

logger = logging.getLogger("vlmserve.api")


def engine_configs(config: EngineConfig, size: int, threads: int) -> tuple[list[EngineConfig], int]:
    """Each engine's config, and the torch threads each runs (0: torch's default)."""
    if size == 1:
        return [config], threads
    device = resolve_device(config.device)
    if device.type == "cuda":
        if device.index is not None:
            raise UserError(f"--device {config.device} names one device; --data-parallel-size {size} needs {size}")
        tp = config.tensor_parallel_size  # engine k's ranks: cuda:k*tp .. cuda:(k+1)*tp - 1
        if torch.cuda.device_count() < size * tp:
            raise UserError(
                f"--data-parallel-size {size} x --tensor-parallel-size {tp} needs {size * tp} CUDA devices "
                f"(engine k runs on cuda:{'k' if tp == 1 else f'k*{tp}..'}); {torch.cuda.device_count()} are visible"
            )
        return [dataclasses.replace(config, device=f"cuda:{k * tp}") for k in range(size)], threads
    if config.memory_budget_bytes is None and config.kv_cache_memory_bytes is None:
        config = dataclasses.replace(config, memory_budget_bytes=default_budget(device) // size)
    return [config] * size, threads or max(1, torch.get_num_threads() // size)


class DataParallelClient:
    def __init__(
        self,
        config: EngineConfig,
        frontend: Frontend,
        *,
        size: int = 1,
        threads: int = 0,
        max_restarts: int = 3,
        heartbeat_timeout_s: float = 10.0,
        stall_timeout_s: float = 60.0,
        metrics: Metrics | None = None,
        loras: list[LoRARequest] | None = None,
    ) -> None:
        """`metrics`: where each engine's per-request timings go (its `engine` label); `loras`: the
        adapters every engine loads when it starts (--lora-modules)."""
        self.frontend = frontend
        configs, engine_threads = engine_configs(config, size, threads)
        if size > 1:
            plan = configs[0].memory_budget_bytes
            logger.info(
                "data parallel: %d engines, each with torch threads: %s, and %s",
                size,
                engine_threads or "torch's default",
                f"a memory budget of {plan / (1 << 30):.2f} GiB" if plan else "the default memory budget",
            )
        self.engines = [
            EngineClient(
                engine_config,
                frontend,
                threads=engine_threads,
                max_restarts=max_restarts,
                heartbeat_timeout_s=heartbeat_timeout_s,
                stall_timeout_s=stall_timeout_s,
                stat_logger=None if metrics is None else metrics.vllm_engines[k],
                index=None if size == 1 else k,
            )
            for k, engine_config in enumerate(configs)
        ]
        for engine in self.engines:
            engine.engine.loras = {lora.lora_name: lora for lora in loras or []}
        self.router = DataParallelRouter(size)

    async def start(self, timeout_s: float = 600.0) -> None:
        """All engines at once, until every one is ready; EngineDeadError (naming the engine) as
        soon as one fails to start, the others stopped."""
        tasks = [asyncio.create_task(engine.start(timeout_s)) for engine in self.engines]
        try:
            for done in asyncio.as_completed(tasks):
                await done
        except EngineDeadError as e:
            if len(self.engines) == 1:
                raise
            failed = next(k for k, t in enumerate(tasks) if t.done() and t.exception() is not None)
            raise EngineDeadError(f"engine {failed}: {e}") from None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def shutdown(self) -> None:
        await asyncio.gather(*(engine.shutdown() for engine in self.engines))

    @property
    def unavailable_reason(self) -> str | None:
        """None while any engine can take a request; else why none can."""
        reasons = [engine.unavailable_reason for engine in self.engines]
        if any(reason is None for reason in reasons):
            return None
        if len(reasons) == 1:
            return reasons[0]
        return "no engine can take requests: " + "; ".join(f"engine {k}: {r}" for k, r in enumerate(reasons))

    async def add_lora(self, lora: LoRARequest) -> None:
        """Into every engine, or none: where one refuses it, those that took it drop it again."""
        results = await asyncio.gather(*(engine.add_lora(lora) for engine in self.engines), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            took = [engine for engine, r in zip(self.engines, results, strict=True) if r is None]
            await asyncio.gather(*(engine.remove_lora(lora.lora_name) for engine in took), return_exceptions=True)
            raise next((e for e in errors if isinstance(e, LoRAError)), errors[0])

    async def remove_lora(self, lora_name: str) -> bool:
        """From every engine; False where none held it."""
        removed = await asyncio.gather(*(engine.remove_lora(lora_name) for engine in self.engines))
        return any(removed)

    async def list_loras(self) -> list[LoRARequest]:
        """The adapters the first engine holds (every engine is given the same)."""
        return await self.engines[0].list_loras()

    async def generate(
        self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, arrival_time: float | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """EngineClient.generate on the engine the router picks among those up."""
        k = self._engine_for(request_id, prompt)
        cost = params.n
        self.router.add(k, cost)
        try:
            async with aclosing(self.engines[k].generate(request_id, prompt, params, arrival_time)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            self.router.remove(k, cost)

    async def pool(self, request_id: str, prompt: ProcessedPrompt, params: PoolingParams) -> PoolingRequestOutput:
        """EngineClient.pool on the engine the router picks among those up."""
        k = self._engine_for(request_id, prompt)
        self.router.add(k, 1)
        try:
            return await self.engines[k].pool(request_id, prompt, params)
        finally:
            self.router.remove(k, 1)

    def _engine_for(self, request_id: str, prompt: ProcessedPrompt) -> int:
        up = [engine.unavailable_reason is None for engine in self.engines]
        holder = next((k for k, engine in enumerate(self.engines) if request_id in engine.queues), None)
        if len(self.engines) == 1 or not any(up) or holder is not None:
            # The one engine; or one that refuses it (none is up; the id is in use there),
            # freeing the segments its token handles name, as with one engine.
            return holder or 0
        return self.router.choose(affinity_keys(prompt), up)
