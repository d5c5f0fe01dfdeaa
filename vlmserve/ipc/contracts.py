"""The plain data that crosses the engine's seams (vLLM v1's contracts, in our size).

The scheduler emits a SchedulerOutput each step; the model runner returns a ModelRunnerOutput.
Neither holds a live object: a request the runner has not seen comes whole (token ids, positions,
items, sampling parameters, block ids), a request it has seen comes as what changed. Both encode
with vlmserve.ipc.serial (msgspec), which is what a tensor-parallel worker will receive."""

from __future__ import annotations

import enum

import msgspec
import torch

from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.inputs import MultiModalItem
from vlmserve.pooling import PoolingParams
from vlmserve.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, kw_only=True):
    """A request the runner has not seen: everything it needs to run it from now on."""

    request_id: str
    prompt_token_ids: list[int]
    mm_items: list[MultiModalItem]
    # [3, num_prompt_tokens] int64 positions; None: the model's decode rule from position 0.
    mrope_positions: torch.Tensor | None
    mrope_delta: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens already in the KV cache (a prefix-cache hit)
    # eos and stop_token_ids: what the sampler masks while the output is shorter than min_tokens.
    all_stop_token_ids: list[int] = msgspec.field(default_factory=list)
    # Its slot in each cache group of fixed-size per-request entries (engine/cache_coordinator.py:
    # the linear-attention layers' state); empty for a model with paged KV alone.
    group_slots: list[int] = msgspec.field(default_factory=list)
    # The LoRA adapter it runs with (None: the base model).
    lora_request: LoRARequest | None = None
    # A pooling request: its prompt's last hidden state is pooled, nothing is sampled.
    pooling_params: PoolingParams | None = None


class CachedRequestData(msgspec.Struct, kw_only=True):
    """A request the runner already holds, as it changed since the step before."""

    request_id: str
    # After a preemption the request's blocks were freed: block_ids replace the old ones (so they
    # do too where blocks held for rejected drafts were freed).
    resumed_from_preemption: bool
    new_block_ids: list[int]
    num_computed_tokens: int
    group_slots: list[int] = msgspec.field(default_factory=list)  # new ones after a preemption


class SchedulerOutput(msgspec.Struct, kw_only=True):
    scheduled_new_reqs: list[NewRequestData] = msgspec.field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = msgspec.field(default_factory=list)
    # Request id -> tokens to compute this step, in batch order.
    num_scheduled_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    # Request id -> indexes into its mm_items of the images/videos to encode this step.
    scheduled_encoder_inputs: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # Encoder outputs (by content hash) the runner may drop.
    free_encoder_hashes: list[str] = msgspec.field(default_factory=list)
    # Requests that ended since the last step: the runner forgets them.
    finished_req_ids: list[str] = msgspec.field(default_factory=list)
    # Copies within a cache group of fixed-size entries, (group, from slot, to slot), before the
    # step's forward (a prefix hit's cached state into its request's slot) and after it (a state
    # saved for prefix caching where a chunk ended at a block boundary).
    copies_before_forward: list[tuple[int, int, int]] = msgspec.field(default_factory=list)
    copies_after_forward: list[tuple[int, int, int]] = msgspec.field(default_factory=list)
    # Structured outputs: the requests sampled this step under a grammar, and their masks, filled
    # once by the engine core (row i: structured_output_request_ids[i]; xgrammar's bitmask
    # [rows, ceil(vocab / 32)] int32, a set bit allowing its token). Every rank applies the same.
    # A request verifying drafts has one row per token it samples (1 + its drafts), in order.
    structured_output_request_ids: list[str] = msgspec.field(default_factory=list)
    grammar_bitmask: torch.Tensor | None = None
    # Speculative decoding: request id -> the drafted tokens this step verifies (its
    # num_scheduled_tokens count them: its last sampled token, then these).
    scheduled_spec_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # Request id -> how many tokens its draft head should propose after this step (mtp; none
    # for a request not named).
    num_drafts_wanted: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class TokenLogprobs(msgspec.Struct, array_like=True):
    """The sampled token's log-probability and rank (1 = most likely) under the model's raw
    distribution, and the `logprobs` most likely tokens with theirs."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    # Request id -> the tokens sampled for it, for the requests whose known tokens were all
    # computed: one, or with drafts verified, the accepted drafts and the token after them.
    sampled_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # Request id -> each sampled token's logprobs, where the request asked for them.
    logprobs: dict[str, list[TokenLogprobs]] = msgspec.field(default_factory=dict)
    # Request id -> how many of the step's tokens stay computed, where that is fewer than its
    # token and accepted drafts: a request with per-request state (Qwen3.5's) that rejected a
    # draft has its state put back as before the step, and computes those tokens again.
    num_kept_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    # Request id -> the drafts its draft head proposed for the next step (mtp).
    draft_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # Request id -> its prompt logprobs (prompt tokens 1.., each given the tokens before it),
    # sent once, with the request's first sampled token, where it asked for them.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = msgspec.field(default_factory=dict)
    # Request id -> its pooled vector (float32), for the pooling requests whose prompt the step
    # finished.
    pooled: dict[str, torch.Tensor] = msgspec.field(default_factory=dict)


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2  # admitted to the running batch (again, after a preemption)
    PREEMPTED = 3


class EngineCoreEvent(msgspec.Struct, array_like=True):
    """A request's change of state in the engine core, at `timestamp` on the engine's
    time.monotonic() (vLLM's EngineCoreEvent; the per-request metrics are intervals between them)."""

    type: EngineCoreEventType
    timestamp: float


class EngineCoreOutput(msgspec.Struct):
    """What one request got in one step: the engine core's output, in-process and on the wire."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # "stop", "length", or None while running
    stop_reason: int | None  # the stop token id, when one ended it
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    # Prompt tokens 1.. with their logprobs, on the request's first output, when asked for.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # The request's events since its last output, when the engine records them (log_stats).
    events: list[EngineCoreEvent] | None = None
    # Speculative decoding: the drafts this step verified for it, and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # A pooling request's vector (float32), with its only output.
    pooled: torch.Tensor | None = None
