"""Messages between the API process and the engine process: msgspec structs over ZMQ in
msgpack (decoded against these types only: a malformed message is refused, never unpickled).
They wrap the engine's own types (ProcessedPrompt, SamplingParams, EngineCoreOutput): there are
no mirror types to keep in step."""

from __future__ import annotations

from typing import Union

import msgspec

from vlmserve.ipc import serial, shm
from vlmserve.ipc.contracts import EngineCoreOutput
from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.pooling import PoolingParams
from vlmserve.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, frozen=True, tag="add"):
    """A processed prompt and one engine request per sample (n > 1: they share the prompt and its
    images). The prompt's items travel without their pixels (empty tensors): each item's pixels
    wait in the shared-memory segment of the same index, which the engine reads and unlinks."""

    request_id: str
    child_ids: list[str]
    params: list[SamplingParams]  # one per child
    prompt: ProcessedPrompt
    segments: list[shm.Segment]
    # Whom the engine shares its steps among (the HTTP request, else the request itself: the engine
    # client names it; see vlmserve.engine.scheduler).
    owner: str = ""
    # The adapter every sample runs with (the request's `model` named it); None: the base model.
    lora_request: LoRARequest | None = None
    # A pooling model's request (one child, params unused): its only output carries its prompt's
    # pooled vector (EngineCoreOutput.pooled), nothing is sampled.
    pooling_params: PoolingParams | None = None


class AbortRequests(msgspec.Struct, frozen=True, tag="abort"):
    request_ids: list[str]
    stopped: bool = False  # a stop string ended them (not a client abort)


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


# The adapter calls (EngineCore.add_lora, remove_lora, list_loras): each is answered by a LoRAReply
# with its call_id, between steps.
class AddLoRA(msgspec.Struct, frozen=True, tag="add_lora"):
    call_id: int
    lora: LoRARequest


class RemoveLoRA(msgspec.Struct, frozen=True, tag="remove_lora"):
    call_id: int
    lora_name: str


class ListLoRAs(msgspec.Struct, frozen=True, tag="list_loras"):
    call_id: int


ToEngine = Union[AddRequest, AbortRequests, Shutdown, AddLoRA, RemoveLoRA, ListLoRAs]  # noqa: UP007 (msgspec reads the Union)


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    memory_plan: str
    max_model_len: int
    # The start-up banner's lines (vlmserve.engine.banner.engine_summary), name -> value.
    summary: dict[str, str] = {}
    # The KV cache as built, as the labels of vLLM's vllm:cache_config_info.
    cache_config: dict[str, str] = {}


class StepOutputs(msgspec.Struct, frozen=True, tag="outputs"):
    outputs: list[EngineCoreOutput]  # the engine core's own output type
    # When the step ended, on the engine's time.monotonic() (the clock of its events; the
    # same clock as the API process's on one machine): the tokens' time in the metrics.
    timestamp: float = 0.0


class RequestFailed(msgspec.Struct, frozen=True, tag="failed"):
    """The engine refused a request, or failed it (its segments are released); `message` names
    why. `internal`: the engine's own error while computing it, not something wrong with the
    request (the client gets a 500 without the message, which goes to the log)."""

    request_id: str
    message: str
    internal: bool = False


class Stats(msgspec.Struct, frozen=True, tag="stats"):
    waiting: int
    running: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    encoder_cache_hits: int
    encoder_cache_misses: int
    preemptions: int
    # The adapters of the running and of the waiting requests (EngineCore.lora_requests_info), each
    # name once, for vllm:lora_requests_info; empty without LoRA.
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []


class LoRAReply(msgspec.Struct, frozen=True, tag="lora_reply"):
    """The answer to the adapter call of the same call_id: `error`, the LoRAError's message ("" if
    it succeeded); `removed`, RemoveLoRA's answer; `loras`, ListLoRAs' (in load order)."""

    call_id: int
    error: str = ""
    removed: bool = False
    loras: list[LoRARequest] = []


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    """Sent every HEARTBEAT_INTERVAL_S by a thread of the engine process, whatever its step loop is
    doing; `pid` tells the running engine's from a killed one's read late."""

    pid: int


FromEngine = Union[Ready, StepOutputs, RequestFailed, Stats, Heartbeat, LoRAReply]  # noqa: UP007

# The engine's own types on the wire (tensors as vlmserve.ipc.serial's extension), no pickle.
to_engine_decoder = serial.decoder(ToEngine)
from_engine_decoder = serial.decoder(FromEngine)
encoder = serial.encoder
