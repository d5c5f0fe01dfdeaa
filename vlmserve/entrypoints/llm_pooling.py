"""The offline API of pooling models (LLM.embed, LLM.encode, LLM.score with vLLM's names): inputs
to processed prompts, the requests run to their pooled vectors.

An input to embed is a string or vLLM's prompt dict ({"prompt" | "prompt_token_ids",
"multi_modal_data"}), taken as it is (no template, as vLLM); the official scripts' object
{"text", "image", "video", "instruction"} or a conversation (a list of messages), rendered with
the chat template and its generation prompt, the object as the official script builds it
(vlmserve/api/retrieval.py). A reranker's query and documents are built into its yes/no
conversation, whatever their form (a string, the object, content parts)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from vlmserve.api.retrieval import embedding_conversation, is_content_parts, reranker_conversation
from vlmserve.entrypoints.llm_engine import LLMEngine
from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import PoolingRequestOutput, ScoringOutput, ScoringRequestOutput
from vlmserve.pooling import PoolerConfig, PoolingParams


class LLM(Protocol):
    """What these functions use of vlmserve.entrypoints.llm.LLM (which calls them)."""

    llm_engine: LLMEngine
    _ids: itertools.count[int]

    def _process_prompt(
        self, prompt: Any, where: str, truncate_prompt_tokens: int | None = None
    ) -> ProcessedPrompt: ...

    def _truncated(
        self, prompt: ProcessedPrompt, truncate_prompt_tokens: int | None, where: str
    ) -> ProcessedPrompt: ...

    def process_chat(self, messages: list[dict[str, Any]], *, where: str = "") -> ProcessedPrompt: ...


PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs")


def pooler_of(llm: LLM) -> PoolerConfig:
    pooler = llm.llm_engine.pooler
    if pooler is None:
        raise ValueError(
            "this model generates text; embeddings and scores need a pooling model, started with "
            "runner='pooling' (--runner pooling)"
        )
    return pooler


def embedding_inputs(prompts: object) -> list[object]:
    """One input, or a list of them; a list of messages is one conversation."""
    if isinstance(prompts, (str, dict)) or _is_conversation(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be an input or a non-empty list of inputs")
    return list(prompts)


def process_embedding_input(
    llm: LLM, item: object, where: str, instruction: str | None, truncate_prompt_tokens: int | None
) -> ProcessedPrompt:
    if isinstance(item, str) or (isinstance(item, dict) and set(item) & set(PROMPT_KEYS)):
        return llm._process_prompt(item, where, truncate_prompt_tokens)  # type: ignore[arg-type]
    if _is_conversation(item):
        conversation = list(item)  # type: ignore[call-overload]
    elif isinstance(item, dict):
        conversation = embedding_conversation(item, instruction, where)
    else:
        raise ValueError(f"{where} must be a string, a prompt dict, an object with text/image/video, or messages")
    return llm._truncated(llm.process_chat(conversation, where=f"{where}: "), truncate_prompt_tokens, where)


def process_score_pair(
    llm: LLM, query: object, document: object, where: tuple[str, str], instruction: str | None
) -> ProcessedPrompt:
    conversation = reranker_conversation(query, document, instruction, where)
    return llm.process_chat(conversation, where=f"{where[0]}, {where[1]}: ")


def score_pairs(data_1: object, data_2: object) -> list[tuple[tuple[str, object], tuple[str, object]]]:
    """vLLM's pairing: one query against each document, or the lists pairwise (equal lengths)."""
    firsts = [data_1] if not isinstance(data_1, list) or is_content_parts(data_1) else list(data_1)
    seconds = [data_2] if not isinstance(data_2, list) or is_content_parts(data_2) else list(data_2)
    if not firsts or not seconds:
        raise ValueError("score needs at least one query and one document")
    single = len(firsts) == 1
    if single:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise ValueError(f"got {len(firsts)} queries for {len(seconds)} documents: give one query, or one per document")
    return [
        ((f"data_1[{0 if single else i}]", a), (f"data_2[{i}]", b))
        for i, (a, b) in enumerate(zip(firsts, seconds, strict=True))
    ]


def run_pooling(
    llm: LLM, prompts: list[ProcessedPrompt], params: PoolingParams, loras: Sequence[LoRARequest | None]
) -> list[PoolingRequestOutput]:
    """Run the requests to their vectors, in order; nothing of the call lingers if one fails."""
    engine = llm.llm_engine
    params.verify(pooler_of(llm))
    for adapter in dict.fromkeys(lora for lora in loras if lora is not None):
        engine.add_lora(adapter)
    ids = [str(next(llm._ids)) for _ in prompts]
    added: list[str] = []
    finals: dict[str, PoolingRequestOutput] = {}
    try:
        for request_id, prompt, lora in zip(ids, prompts, loras, strict=True):
            engine.add_pooling_request(request_id, prompt, params, lora)
            added.append(request_id)
        while len(finals) < len(ids):
            engine.step()
            finals.update((output.request_id, output) for output in engine.take_pooled())
    except BaseException:
        for request_id in added:
            if request_id not in finals:
                engine.abort_request(request_id)
        raise
    return [finals[request_id] for request_id in ids]


def cosine_scores(
    pairs: list[tuple[tuple[str, object], tuple[str, object]]],
    vectors: dict[str, PoolingRequestOutput],
    prompts: dict[str, ProcessedPrompt],
) -> list[ScoringRequestOutput]:
    """An embedding model's scores: the cosine similarity of each pair's embeddings (each input's
    vector and prompt by its label)."""
    out = []
    for i, ((a, _), (b, _)) in enumerate(pairs):
        score = float(torch.nn.functional.cosine_similarity(vectors[a].outputs.data, vectors[b].outputs.data, dim=0))
        ids = [*prompts[a].prompt_token_ids, *prompts[b].prompt_token_ids]
        out.append(ScoringRequestOutput(f"score-{i}", ScoringOutput(score), ids))
    return out


def _is_conversation(value: object) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)
