"""The model runner's own copy of a request (vLLM's CachedRequestState): filled from the
SchedulerOutput's plain data when the request first comes, changed by what each step says of it,
forgotten when the scheduler says it finished."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from vlmserve.engine.logits_processors import TokenHistory
from vlmserve.engine.prompt_logprobs import new_buffer
from vlmserve.ipc.contracts import CachedRequestData, NewRequestData, TokenLogprobs
from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.inputs import MultiModalItem
from vlmserve.pooling import PoolingParams
from vlmserve.sampling_params import SamplingParams

# (start, end, mrope_delta, num_prompt_tokens) -> [3, end - start] positions
DecodePositions = Callable[[int, int, int, int], torch.Tensor]


@dataclass
class CachedRequestState:
    """A request as the runner holds it, from its NewRequestData on; it lives until the request
    finishes (across preemptions, so a seeded generator continues where it was)."""

    request_id: str
    token_ids: list[int]  # prompt, then every token sampled for it
    num_prompt_tokens: int
    mm_items: list[MultiModalItem]
    mrope_positions: torch.Tensor | None  # [3, num_prompt_tokens]
    mrope_delta: int
    params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    all_stop_token_ids: list[int]
    group_slots: list[int] = field(default_factory=list)  # its slot in each slot group (cache_coordinator.py)
    # Prompt logprobs, one entry per prompt token after the first, filled chunk by chunk (None:
    # not asked for).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    pooling_params: PoolingParams | None = None  # a pooling request (pooled, never sampled)

    @classmethod
    def from_new(cls, new: NewRequestData) -> CachedRequestState:
        seed = new.sampling_params.seed
        return cls(
            request_id=new.request_id,
            token_ids=list(new.prompt_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            mm_items=new.mm_items,
            mrope_positions=new.mrope_positions,
            mrope_delta=new.mrope_delta,
            params=new.sampling_params,
            generator=None if seed is None else torch.Generator().manual_seed(seed),
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            all_stop_token_ids=list(new.all_stop_token_ids),
            group_slots=list(new.group_slots),
            lora_request=new.lora_request,
            pooling_params=new.pooling_params,
            prompt_logprobs=None
            if new.sampling_params.prompt_logprobs is None
            else new_buffer(len(new.prompt_token_ids)),
        )

    def update(self, cached: CachedRequestData) -> None:
        """What a step says changed: new blocks (all of them after a preemption), the tokens computed."""
        if cached.resumed_from_preemption:
            self.block_ids = list(cached.new_block_ids)
        else:
            self.block_ids.extend(cached.new_block_ids)
        self.num_computed_tokens = cached.num_computed_tokens
        self.group_slots = list(cached.group_slots)

    @property
    def state_slot(self) -> int:
        """Its slot in the state layers' slot group (the one slot group a model may have)."""
        return self.group_slots[0]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def samples_prompt_logprobs(self) -> bool:
        """Whether this step's rows of its prompt are scored: it asked, and nothing is sampled yet
        (after that, a recompute after a preemption has them already)."""
        return self.prompt_logprobs is not None and len(self.token_ids) == self.num_prompt_tokens

    def history(self, drafts: list[int] | None = None) -> TokenHistory:
        """Its tokens so far (and, for a row verifying drafts, the drafts before the row)."""
        tokens = self.token_ids + drafts if drafts else self.token_ids
        return TokenHistory(tokens, self.num_prompt_tokens, self.all_stop_token_ids)

    def positions(self, start: int, end: int, decode_positions: DecodePositions) -> torch.Tensor:
        """[3, end - start] positions of tokens [start, end): the prompt's own, then the model's
        rule for generated tokens (VLModel.decode_positions)."""
        p = self.num_prompt_tokens
        pieces = []
        if start < p and self.mrope_positions is not None:
            pieces.append(self.mrope_positions[:, start : min(end, p)])
            start = min(end, p)
        if start < end:
            # A prompt without precomputed positions starts the rule at position 0.
            delta = self.mrope_delta if self.mrope_positions is not None else 0
            pieces.append(decode_positions(start, end, delta, p))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
