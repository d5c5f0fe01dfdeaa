"""The calls the engine core makes on a tensor-parallel rank and the rank's replies, as msgspec
messages (no pickle): rank 0 reads them from the engine core's pipe and broadcasts them to the
other ranks (engine/worker.py); in-process the executor calls the worker's methods directly."""

from __future__ import annotations

import msgspec

from vlmserve.ipc import serial
from vlmserve.ipc.contracts import ModelRunnerOutput, SchedulerOutput
from vlmserve.lora.request import AdapterInfo, LoRARequest
from vlmserve.multimodal.inputs import MultiModalItem


class Plan(msgspec.Struct, tag=True):
    """Describe this rank for the memory plan; with `dummy_items`, also run the worst-case
    profile step (ModelRunner.profile_run) and report its peak."""

    profile: bool
    dummy_items: list[MultiModalItem] = msgspec.field(default_factory=list)
    num_tokens: int = 0
    max_model_len: int = 0
    num_seqs: int = 0
    block_size: int = 0


class BindCaches(msgspec.Struct, tag=True):
    """The paged KV's blocks, and the slots of each slot group (engine/cache_coordinator.py)."""

    num_blocks: int
    block_size: int
    group_slots: list[int] = msgspec.field(default_factory=list)


class Execute(msgspec.Struct, tag=True):
    step: SchedulerOutput


class FreeEncoderOutputs(msgspec.Struct, tag=True):
    content_hashes: list[str]


class Reset(msgspec.Struct, tag=True):
    pass


class Shutdown(msgspec.Struct, tag=True):
    pass


class DigestRequests(msgspec.Struct, tag=True):
    """Each rank's digest of the requests it holds (ids and token ids): equal on every rank
    while the ranks agree (a check for tests and debugging)."""


class AddLoRA(msgspec.Struct, tag=True):
    """Read and check an adapter (each rank its slice); a bad one is the reply's lora_error."""

    lora: LoRARequest


class RemoveLoRA(msgspec.Struct, tag=True):
    lora_name: str


WorkerCall = Plan | BindCaches | Execute | FreeEncoderOutputs | Reset | Shutdown | DigestRequests | AddLoRA | RemoveLoRA


class RankInfo(msgspec.Struct, array_like=True):
    """What the memory plan needs of one rank (its own shard's numbers)."""

    weights_bytes: int
    kv_bytes_per_token: int
    # One request's slot in the model's slot group (its linear-attention layers' state); 0: the
    # model has paged KV alone.
    slot_bytes: int
    # What this rank may use in all by default (its device's, or its share of the host's; the
    # config's memory_budget_bytes, per rank, overrides it); 0 when not profiled.
    budget_bytes: int
    activation_bytes: int = 0  # the profile step's peak; 0 when not profiled


class StepResult(msgspec.Struct):
    output: ModelRunnerOutput
    # Request id -> why, for the requests that raised even when run alone (the core frees them).
    failed: dict[str, str] = msgspec.field(default_factory=dict)


class Reply(msgspec.Struct):
    step: StepResult | None = None
    ranks: list[RankInfo] = msgspec.field(default_factory=list)
    digests: list[int] = msgspec.field(default_factory=list)  # DigestRequests: (count, digest) per rank
    lora: AdapterInfo | None = None  # AddLoRA: the adapter loaded
    lora_error: str | None = None  # AddLoRA: why the adapter cannot be served (the rank goes on)
    # Set when the call failed outside any one request: the rank exits after sending it.
    error: str | None = None


call_decoder = serial.decoder(WorkerCall)
reply_decoder = serial.decoder(Reply)
