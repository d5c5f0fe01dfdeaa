"""The LoRA adapters the server serves over its model (vLLM's OpenAIServingModels): the names a
request's `model` may give besides the served model's, the adapters' cards in GET /v1/models, and
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (served with
--allow-runtime-lora-updating), with vLLM's bodies, answers and error codes.

The server gives each adapter its lora_int_id (1, 2, ... in the order loaded, never reused) and
keeps the list; the engine holds the weights (EngineCore.add_lora), each engine of a data-parallel
server the same ones, and an engine started again after a death loads them again."""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, model_validator

from vlmserve.api.engine_supervisor import EngineDeadError
from vlmserve.api.protocol import APIError, check_text, refuse_unsupported
from vlmserve.arg_types import LoRAModulePath
from vlmserve.lora.request import LoRAError, LoRARequest

logger = logging.getLogger("vlmserve.api")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_path: str

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> LoadLoRAAdapterRequest:
        why = "an adapter's weights are not replaced in place; unload it, then load the new one"
        refuse_unsupported(self.model_extra, {"load_inplace": ((False, None), why)})
        return self


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str | None = None
    lora_int_id: int | None = None


class AdapterEngines(Protocol):
    """What the registry asks of the engines (DataParallelClient's adapter calls)."""

    async def add_lora(self, lora: LoRARequest) -> None: ...

    async def remove_lora(self, lora_name: str) -> bool: ...


@dataclass(frozen=True)
class Adapter:
    lora: LoRARequest
    parent: str  # the served model name /v1/models lists it under


class ServingModels:
    def __init__(self, engines: AdapterEngines | None, base_names: tuple[str, ...]) -> None:
        """`base_names`: the served model's names (the first one is an adapter's default parent)."""
        self.engines = engines
        self.base_names = base_names
        self.adapters: dict[str, Adapter] = {}  # by name, in load order
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()  # one load or unload at a time: a name is checked and taken at once

    def add_static(self, modules: list[LoRAModulePath]) -> list[LoRARequest]:
        """--lora-modules, before the engines start (they load these when they start): their
        LoRARequests, ids given in order."""
        for module in modules:
            lora = LoRARequest(module.name, next(self._ids), module.path)
            self.adapters[module.name] = Adapter(lora, module.base_model_name or self.base_names[0])
        return [adapter.lora for adapter in self.adapters.values()]

    def get(self, name: str) -> LoRARequest | None:
        adapter = self.adapters.get(name)
        return None if adapter is None else adapter.lora

    def cards(self, created: int) -> list[dict[str, Any]]:
        """The adapters' entries in GET /v1/models (vLLM's ModelCard fields: root, the adapter's
        folder; parent, the served model it runs over)."""
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vlmserve",
                "root": adapter.lora.lora_path,
                "parent": adapter.parent,
                "max_model_len": None,
            }
            for name, adapter in self.adapters.items()
        ]

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        """POST /v1/load_lora_adapter: the adapter read and checked by every engine, then served
        under its name. vLLM's answers: 400 for a name already taken or an adapter the engine
        refuses (the message says what is wrong), 404 for a folder that does not exist."""
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", kind="InvalidUserInput")
        check_text(name, "lora_name")
        check_text(path, "lora_path")
        async with self._lock:
            if name in self.base_names:
                raise APIError(400, f"'{name}' is the served model's name; give the adapter another", "lora_name")
            if name in self.adapters:
                message = (
                    f"The lora adapter '{name}' has already been loaded. Unload it first to load another as '{name}'."
                )
                raise APIError(400, message, kind="InvalidUserInput")
            if not Path(path).is_dir():
                message = f"No adapter found for {path}: not a directory (the folder holding adapter_config.json)"
                raise APIError(404, message, "lora_path", kind="NotFoundError")
            lora = LoRARequest(name, next(self._ids), path)
            assert self.engines is not None
            try:
                await self.engines.add_lora(lora)
            except LoRAError as e:
                raise APIError(400, f"adapter '{name}' cannot be loaded: {e}", kind="BadRequestError") from None
            except EngineDeadError as e:
                raise APIError(503, str(e), code="engine_unavailable") from None
            self.adapters[name] = Adapter(lora, self.base_names[0])
        logger.info("loaded LoRA adapter %r from %s", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        """POST /v1/unload_lora_adapter, by name or lora_int_id: no longer served (the engines drop
        its weights); an unknown one is vLLM's 404."""
        if not body.lora_name and body.lora_int_id is None:
            raise APIError(400, "either 'lora_name' or 'lora_int_id' needs to be provided.", kind="InvalidUserInput")
        async with self._lock:
            name = body.lora_name or next(
                (n for n, a in self.adapters.items() if a.lora.lora_int_id == body.lora_int_id), None
            )
            if name is None or name not in self.adapters:
                message = (
                    f"The lora adapter '{name}' cannot be found."
                    if name
                    else f"No lora adapter has lora_int_id {body.lora_int_id}."
                )
                raise APIError(404, message, kind="NotFoundError")
            del self.adapters[name]  # no new request runs with it from here on
            assert self.engines is not None
            try:
                await self.engines.remove_lora(name)
            except (LoRAError, EngineDeadError) as e:  # not served any more all the same
                logger.warning("unloading LoRA adapter %r: %s", name, e)
        logger.info("unloaded LoRA adapter %r", name)
        return f"Success: LoRA adapter '{name}' removed successfully."
