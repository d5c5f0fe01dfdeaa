"""Request outputs with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vlmserve.multimodal.inputs import MultiModalItem


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None
    # One {token id: Logprob} per generated token (the sampled one and the top ones), when asked.
    logprobs: list[dict[int, Logprob]] | None = None
    # Speculative decoding: the drafted tokens verified for this sample, and how many were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class MultiModalItemInfo:
    """One image or video of the prompt as the processor took it, without its pixels. Boxes a
    Qwen2.5-VL model writes are in resized_size's pixels; vlmserve.grounding maps them back."""

    modality: str  # "image" or "video"
    # Its placeholder tokens are prompt_token_ids[offset : offset + length].
    offset: int
    length: int
    original_size: tuple[int, int]  # (width, height) as decoded, after EXIF rotation
    resized_size: tuple[int, int]  # (width, height) the model saw

    @classmethod
    def from_item(cls, item: MultiModalItem) -> MultiModalItemInfo:
        return cls(item.modality, item.offset, item.length, item.original_size, item.resized_size)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Placeholder tokens per image in the prompt (usage accounting).
    num_image_tokens: list[int] = field(default_factory=list)
    # Prompt tokens whose KV came from the prefix cache.
    num_cached_tokens: int = 0
    # The prompt's images and videos, in prompt order: where they are and their sizes.
    mm_items: list[MultiModalItemInfo] = field(default_factory=list)
    # vLLM's prompt logprobs, when asked for: None for the first prompt token, then per token a
    # {token id: Logprob} holding the prompt's token and the most likely ones at its position.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


# -- pooling models (vLLM's PoolingRequestOutput and its embedding and scoring views) -------------


@dataclass
class PoolingOutput:
    data: torch.Tensor  # float32: an embedding, or a reranker's one score


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()), output.prompt_token_ids)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
