"""A request inside the engine: its tokens, how many have been computed, and its KV blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import replace

import torch

from vlmserve.engine.speculative import DraftBackoff, NgramIndex
from vlmserve.ipc.contracts import EngineCoreEvent, EngineCoreEventType
from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.inputs import MultiModalItem, ProcessedPrompt
from vlmserve.pooling import PoolingParams
from vlmserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        owner: str = "",
        lora: tuple[LoRARequest, str, bool] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        """lora: the adapter it runs with, the key its cached KV and encoder outputs are stored
        under, and whether the adapter changes image embeddings. pooling_params: a pooling
        request, which ends with its prompt (its pooled vector its only output)."""
        assert params.n == 1, "the engine runs one sample per request; n > 1 is fanned out above it"
        self.request_id = request_id
        # Whom the scheduler shares the engine among: the server's HTTP request this sequence serves
        # (its samples, beams and prompts share one), "" for the offline API (one caller).
        self.owner = owner
        self.prompt_token_ids = prompt.prompt_token_ids
        self.mm_items: list[MultiModalItem] = prompt.mm_items
        self.mrope_positions: torch.Tensor | None = prompt.mrope_positions
        self.mrope_delta = prompt.mrope_delta
        self.cache_salt = prompt.cache_salt
        self.lora_request: LoRARequest | None = None
        if lora is not None:
            # An adapter changes the KV of every token: its blocks hash apart from the base model's
            # and other adapters'; one that changes the vision tower has encoder outputs of its own.
            self.lora_request, key, vision = lora
            self.cache_salt = f"{self.cache_salt or ''}|lora:{key}"
            if vision:
                self.mm_items = [
                    replace(item, content_hash=f"{item.content_hash}|lora:{key}") for item in self.mm_items
                ]
        self.params = params
        self.pooling_params = pooling_params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        # What min_tokens masks in the sampler: eos (even with ignore_eos, as vLLM) and stop ids.
        self.all_stop_token_ids = eos_token_ids | self.stop_token_ids
        room = max_model_len - len(self.prompt_token_ids)
        self.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.output_token_ids: list[int] = []
        # All tokens whose K/V is in the cache; the scheduler advances it.
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when last admitted, and times preempted.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # Prefix-cache hashes of the request's full blocks, filled in by the KV cache manager.
        self.block_hashes: list[bytes] = []
        # What the model runner has of it: whether it was sent whole, and how many block ids.
        self.sent_to_runner = False
        self.num_sent_blocks = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Events not yet sent with an output (only when the scheduler records them).
        self.events: list[EngineCoreEvent] = []
        # Speculative decoding: the drafts the next step verifies (set before each schedule), how
        # many the request drafts (None: no speculation), and the n-gram proposer's copy of its tokens.
        self.spec_token_ids: list[int] = []
        self.backoff: DraftBackoff | None = None
        self.draft_index: NgramIndex | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def record_event(self, event_type: EngineCoreEventType) -> None:
        self.events.append(EngineCoreEvent(event_type, time.monotonic()))

    def take_events(self) -> list[EngineCoreEvent] | None:
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    @property
    def draft_room(self) -> int:
        """The most drafts a step may verify for it: its max_tokens less its output and the token
        the step samples after them."""
        return self.max_tokens - len(self.output_token_ids) - 1

    @property
    def is_decoding(self) -> bool:
        """Every known token but the last computed: the next step decodes (or verifies drafts)."""
        return self.num_computed_tokens == self.num_tokens - 1 and bool(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        # Before min_tokens the sampler masks stop tokens; only the length can end it.
        may_stop = len(self.output_token_ids) >= self.params.min_tokens
        if may_stop and (token_id in self.eos_token_ids or token_id in self.stop_token_ids):
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = token_id if token_id in self.stop_token_ids else None
        elif len(self.output_token_ids) >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
