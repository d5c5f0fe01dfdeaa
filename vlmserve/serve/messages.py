"""Messages between the API process and the engine process: msgspec structs over ZMQ in
msgpack (decoded against these types only: a malformed message is refused, never unpickled)."""

from __future__ import annotations

from typing import Union

import msgspec

from vlmserve.engine.contracts import EngineCoreOutput


class ItemSpec(msgspec.Struct, frozen=True):
    """One image or video of a request: where its placeholders are and where its pixels wait."""

    offset: int
    length: int
    grid: tuple[int, int, int]
    content_hash: str
    shm_name: str
    shape: tuple[int, ...]  # the pixel array's: [patches, patch_dim] (Qwen2-VL), [3, 448, 448] (Qwen-VL)
    original_size: tuple[int, int]
    resized_size: tuple[int, int]
    dtype: str = "float32"
    modality: str = "image"
    second_per_grid_t: float | None = None  # videos: seconds per temporal patch


class SamplingSpec(msgspec.Struct, frozen=True):
    """What the engine needs of SamplingParams (stop strings stay in the API process)."""

    temperature: float
    top_p: float
    top_k: int
    max_tokens: int | None
    seed: int | None
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None = None


class AddRequest(msgspec.Struct, frozen=True, tag="add"):
    request_id: str
    # One engine request per sample (n > 1): they share the prompt and its images.
    child_ids: list[str]
    params: list[SamplingSpec]
    prompt_token_ids: list[int]
    items: list[ItemSpec]


class AbortRequests(msgspec.Struct, frozen=True, tag="abort"):
    request_ids: list[str]
    stopped: bool = False  # a stop string ended them (not a client abort)


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


ToEngine = Union[AddRequest, AbortRequests, Shutdown]  # noqa: UP007 (msgspec reads the Union)


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    memory_plan: str
    max_model_len: int


class StepOutputs(msgspec.Struct, frozen=True, tag="outputs"):
    outputs: list[EngineCoreOutput]  # the engine core's own output type


class RequestFailed(msgspec.Struct, frozen=True, tag="failed"):
    """The engine refused a request (its segments are released); `message` names why."""

    request_id: str
    message: str


class Stats(msgspec.Struct, frozen=True, tag="stats"):
    waiting: int
    running: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    encoder_cache_hits: int
    encoder_cache_misses: int
    preemptions: int


FromEngine = Union[Ready, StepOutputs, RequestFailed, Stats]  # noqa: UP007

to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
encoder = msgspec.msgpack.Encoder()
