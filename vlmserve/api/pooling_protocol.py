"""Request bodies of the pooling models' API, as vLLM takes them: /v1/embeddings (OpenAI's body,
or vLLM's chat form with `messages`), /pooling (the same bodies, the raw vectors back), /rerank
(Jina's and Cohere's shape; /v1/rerank and /v2/rerank too) and /score. Unknown fields are ignored
with a warning in the log, as the other endpoints do."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from vlmserve.api.protocol import MESSAGE_SCHEMA, ChatTemplateField, check_continuation, refuse_unsupported
from vlmserve.sampling_params import INT64_MAX

# An input to embed: a text, or token ids.
EmbeddingInput = str | list[int] | list[str] | list[list[int]]
# A query or a document: a text, vLLM's {"content": [parts]}, the Qwen3-VL retrieval scripts'
# object {"text", "image", "video", "fps", "instruction"}, or a list of content parts.
ScoreItem = str | dict[str, Any] | list[dict[str, Any]]


class _PoolingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    user: str | None = None
    # vLLM's: keep the last N tokens of each prompt (-1: max_model_len).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    # vLLM's; the Qwen tokenizers add no special tokens either way.
    add_special_tokens: StrictBool | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _PoolingFields:
        refuse_unsupported(self.model_extra, {})
        return self


class _EmbeddingFields(_PoolingFields):
    encoding_format: Literal["float", "base64"] = "float"
    # Matryoshka truncation (the first `dimensions` values, normalised again), for a model trained for it.
    dimensions: int | None = Field(default=None, le=INT64_MAX)
    # vLLM's: False for the pooled hidden state as it is (None: the model's, normalised).
    normalize: StrictBool | None = None


class EmbeddingCompletionRequest(_EmbeddingFields):
    """OpenAI's embeddings body: each input (a string, or token ids) is embedded as it is."""

    input: EmbeddingInput


class EmbeddingChatRequest(_EmbeddingFields):
    """vLLM's chat form: the conversation rendered with the chat template (and, by default, its
    generation prompt: the Qwen3-VL embedding models pool the token after it), one embedding."""

    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={"items": MESSAGE_SCHEMA})
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: ChatTemplateField | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_of_the_two(self) -> EmbeddingChatRequest:
        check_continuation(self.continue_final_message, self.add_generation_prompt)
        return self


class _ScoreFields(_PoolingFields):
    # A reranker's task (Qwen3-VL-Reranker's "<Instruct>"), or an embedding model's instruction
    # for the inputs given as objects or content parts; None: the model's default. An extension.
    instruction: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None


class RerankRequest(_ScoreFields):
    """vLLM's /rerank: each document scored against the query, the best first."""

    query: ScoreItem
    # A list of documents, or vLLM's {"content": [parts]}: each part one document.
    documents: list[ScoreItem] | dict[str, Any]
    # The best top_n results (0, vLLM's default: all).
    top_n: int = Field(default=0, ge=0, le=INT64_MAX)
    # Each result's document in the response (vLLM always returns it; Cohere's and Jina's field).
    return_documents: StrictBool = True


class ScoreRequest(_ScoreFields):
    """vLLM's /score: text_1 against each of text_2 (one first item), or the two lists pairwise."""

    # One item (a list of content parts is one), or a list of them.
    text_1: str | dict[str, Any] | list[ScoreItem]
    text_2: str | dict[str, Any] | list[ScoreItem]
