"""Request bodies of the OpenAI-compatible API, validated with the server's limits."""

from __future__ import annotations

import json
import logging
import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from vlmserve.api.beam_search import MAX_BEAM_WIDTH
from vlmserve.api.json_limits import JSONLimitError, check_json_limits
from vlmserve.api.reasoning import thinking_enabled
from vlmserve.api.tool_calling import (
    MAX_TOOLS,
    ChatTool,
    ToolChoice,
    check_tool_choice,
    effective_tool_choice,
    forced_tool_grammar,
    forced_tool_schema,
    reasons_before_forced_calls,
)
from vlmserve.errors import APIError
from vlmserve.multimodal.image import DETAILS
from vlmserve.multimodal.video import INT_OPTIONS, MAX_OPTION, NUMBER_OPTIONS, SAMPLE_FPS_RANGE, TIME_OPTIONS
from vlmserve.parser_names import XML_TOOL_CALL_PARSER
from vlmserve.processor.chat import MAX_ROLE_LENGTH, MAX_UUID_LENGTH, SIZING_KEYS
from vlmserve.sampling_params import (
    FLOAT32_TINY,
    INT64_MAX,
    INT64_MIN,
    SamplingParams,
    StructuredOutputsParams,
)

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 512
MAX_BAD_WORDS = 64
MAX_LOGIT_BIAS = 1024  # entries
LOGIT_BIAS_LIMIT = 100.0  # values are clamped to +-this, as OpenAI's API and vLLM do
MAX_LENGTH_PENALTY = 1e6  # |length_penalty|: any larger only overflows the score
# A request's own chat template (vLLM's `chat_template`, under --trust-request-chat-template):
# the published Qwen templates are under 10,000 characters.
MAX_CHAT_TEMPLATE_CHARS = 128 * 1024
ChatTemplateField = Annotated[str, Field(min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS)]

logger = logging.getLogger("vlmserve.api")


def text_problem(value: str) -> str | None:
    """What makes `value` unusable as text, if anything: a NUL character, or a lone surrogate
    (not valid Unicode, so it cannot be encoded to go to the engine)."""
    if "\x00" in value:
        return "contains a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate (not valid Unicode)"
    return None


def check_text(value: str, param: str) -> str:
    """Text must be valid Unicode (no lone surrogates) without NUL characters."""
    problem = text_problem(value)
    if problem:
        raise APIError(400, f"{param} {problem}", param)
    return value


def _object(properties: dict[str, Any], required: list[str], rules: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, **rules}


# The message shapes vlmserve.processor.chat reads, for the OpenAPI schema only (validation is
# parse_chat_messages', whose messages name what is wrong): without it the published schema
# says "a list of objects", and no client or schema-driven test learns what a message holds.
_MEDIA_SOURCE = {
    "type": "string",
    "format": "uri",
    "minLength": 1,
    "description": "a data: or http(s):// URL (file:// under --allowed-local-media-path)",
}
_SIZING = {key: {"type": "integer", "minimum": 1} for key in SIZING_KEYS}
_VIDEO_OPTIONS = {
    **{key: {"type": "integer", "minimum": 1, "maximum": MAX_OPTION} for key in INT_OPTIONS},
    **{key: {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_OPTION} for key in NUMBER_OPTIONS},
    **{key: {"type": "number", "minimum": 0, "maximum": MAX_OPTION} for key in TIME_OPTIONS},
    "sample_fps": {"type": "number", "minimum": SAMPLE_FPS_RANGE[0], "maximum": SAMPLE_FPS_RANGE[1]},
}
# The rules between options of one object: a resize names both sides; a video gives fps or nframes.
_SIZING_RULES = {"dependentRequired": {"resized_height": ["resized_width"], "resized_width": ["resized_height"]}}
_VIDEO_RULES = {**_SIZING_RULES, "not": {"required": ["fps", "nframes"]}}


# vLLM's media uuid: a part with one keeps its media under it; a later part with the uuid alone
# (its source null or empty) reuses it.
_UUID = {"type": "string", "minLength": 1, "maxLength": MAX_UUID_LENGTH}


def _part(kind: str, source: dict[str, Any], options: dict[str, Any], rules: dict[str, Any]) -> dict[str, Any]:
    return _object({"type": {"const": kind}, kind: source, "uuid": _UUID, **options}, ["type", kind], rules)


CONTENT_PART_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        _part("text", {"type": "string"}, {}, {}),
        _part(
            "image_url",
            _object({"url": _MEDIA_SOURCE, "detail": {"enum": list(DETAILS)}, **_SIZING}, ["url"], _SIZING_RULES),
            _SIZING,
            _SIZING_RULES,
        ),
        _part("image", _MEDIA_SOURCE, _SIZING, _SIZING_RULES),
        _part(
            "video_url",
            _object({"url": _MEDIA_SOURCE, **_VIDEO_OPTIONS}, ["url"], _VIDEO_RULES),
            _VIDEO_OPTIONS,
            _VIDEO_RULES,
        ),
        _part(
            "video",
            {"anyOf": [_MEDIA_SOURCE, {"type": "array", "items": _MEDIA_SOURCE, "minItems": 1}]},
            _VIDEO_OPTIONS,
            _VIDEO_RULES,
        ),
        _object({"type": {"enum": ["image_url", "image", "video_url", "video"]}, "uuid": _UUID}, ["type", "uuid"], {}),
    ]
}
MESSAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        # system, user, assistant, tool, or any role the chat template renders (as vLLM)
        "role": {"type": "string", "minLength": 1, "maxLength": MAX_ROLE_LENGTH},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": CONTENT_PART_SCHEMA}, {"type": "null"}]},
    },
    "required": ["role"],
}


# Fields of vLLM's request schemas that vlmserve does not implement: a request that sets one to
# anything but the value meaning "off" is refused with a 400 naming it, never run as if it had
# not been sent. Each maps to (the values meaning "off", why).
_OFF = (None,)
UNSUPPORTED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "prompt_embeds": (_OFF, "prompt embeddings as input are not supported"),
    "logits_processors": (_OFF, "custom logits processors are not loaded"),
    "cache_salt": (_OFF, "the prefix cache has no per-request salt"),
    "kv_transfer_params": (_OFF, "there is no disaggregated prefill"),
    "vllm_xargs": (_OFF, "there are no custom extensions"),
    "repetition_detection": (_OFF, "repetition detection is not implemented"),
    "structural_tag": (_OFF, "structural tags are not implemented (structured_outputs: json, regex, choice, grammar)"),
    "guided_whitespace_pattern": (_OFF, "whitespace patterns are not implemented (disable_any_whitespace is)"),
    "guided_decoding_backend": ((None, "auto", "xgrammar"), "xgrammar is the only structured-output backend"),
    "priority": ((None, 0), "requests are scheduled first come, first served"),
    "documents": (_OFF, "documents are not passed to the chat template"),
}
# Chat only: nothing is refused now (echo and tool calling are implemented).
_CHAT_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {}
# Completions only: suffix.
_COMPLETION_UNSUPPORTED = {
    "suffix": ((None,), "suffix is not supported (nor by vLLM)"),
}
MAX_IGNORED_SHOWN = 10  # unknown field names a warning lists


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    for v in off:
        if v is None or isinstance(v, bool):
            if value is v:
                return True
        elif isinstance(v, int | float):  # a number, but not a bool (True == 1 in Python)
            if isinstance(value, int | float) and not isinstance(value, bool) and value == v:
                return True
        elif value == v:
            return True
    return False


def refuse_unsupported(extra: dict[str, Any] | None, table: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    """A 400 naming the first field of `table` set to a value other than "off"; every other
    unknown field is ignored with a warning in the log (as vLLM does)."""
    ignored = []
    for name, value in (extra or {}).items():
        if name in table:
            off, why = table[name]
            if not _is_off(value, off):
                raise APIError(400, f"{name} is not supported by vlmserve: {why}", name, "unsupported_field")
        else:
            ignored.append(name[:64])
    if ignored:
        logger.warning("fields present in the request but ignored: %s", ignored[:MAX_IGNORED_SHOWN])


class StreamOptions(BaseModel):
    # vLLM's default: `stream_options: {}` asks for usage.
    include_usage: StrictBool = True
    # vLLM's: usage (so far) on every chunk, when include_usage is on too.
    continuous_usage_stats: StrictBool = False


class JSONSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    # OpenAI's field is `schema`; pydantic's BaseModel has a `schema` method, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object) or
    json_schema (JSON that follows json_schema.schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsFields(BaseModel):
    """vLLM's structured_outputs object (exactly one of json, regex, choice, grammar, json_object)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False


class _SamplingFields(BaseModel):
    # Unknown fields are kept aside (model_extra) to be refused or ignored with a warning.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    # Integers the engine keeps as int64, floats it computes with in float32 (sampling_params.py).
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    # The smallest top_p the engine takes is published as the minimum (not "> 0"): a client or a
    # schema-driven test reading the schema then never sends a value that the validator refuses.
    top_p: Annotated[float, Field(le=1.0, json_schema_extra={"minimum": FLOAT32_TINY})] | None = None
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    n: int = Field(default=1, ge=1, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = Field(
        default=None, max_length=MAX_STOP_STRINGS
    )
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    user: str | None = None
    # vLLM's sampling extensions and OpenAI's penalties; ranges are SamplingParams' (400 outside).
    repetition_penalty: float | None = None  # None: the --generation-config default
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None  # None: the --generation-config default
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and vLLM's older
    # guided_* fields (one of them per request).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # The Qwen tokenizers add no special tokens (no BOS), so either value gives the same ids, as
    # in vLLM; accepted with vLLM's defaults (chat: false, completions: true).
    add_special_tokens: StrictBool | None = None
    # vLLM's: the prompt's token ids and each choice's generated ones in the response.
    return_token_ids: StrictBool | None = None
    # Decoding joins special tokens without spaces, as a fast tokenizer does (vLLM's too).
    spaces_between_special_tokens: StrictBool = True
    # vLLM's: the response id is built on it (the engine's own id stays unique).
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    # n samples are drawn; a best_of other than n would need sampling more and ranking.
    best_of: int | None = None
    # vLLM's prompt truncation (processor/truncation.py): keep the last (left) or first (right)
    # N tokens; -1: max_model_len.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's per-request media options (processor/media_options.py).
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    # vLLM's: each prompt token's logprob and the most likely tokens there (-1: the vocabulary;
    # bounded by --max-logprobs), in the response as vLLM returns them.
    prompt_logprobs: int | None = Field(default=None, le=INT64_MAX)
    # vLLM's: only these tokens may be generated.
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = None
    # vLLM's: logprob tokens written "token:<id>" instead of their text.
    return_tokens_as_token_ids: StrictBool | None = None
    # vLLM's beam search: n beams (api/serving_beam.py), ranked by cum_logprob / len ** length_penalty.
    use_beam_search: StrictBool = False
    length_penalty: float = 1.0

    _unsupported: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = UNSUPPORTED_FIELDS

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _SamplingFields:
        refuse_unsupported(self.model_extra, self._unsupported)
        # vLLM's rule: a non-empty stream_options needs stream (null and {} pass).
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise APIError(400, "stream_options can only be given when stream is true", "stream_options")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported by vlmserve: n samples are drawn and all returned", "best_of")
        if self.request_id is not None:
            check_text(self.request_id, "request_id")
        # vLLM's rules, in its words.
        if self.prompt_logprobs is not None:
            if self.prompt_logprobs < -1:
                raise APIError(400, "`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
            if self.stream and self.prompt_logprobs != 0:
                raise APIError(400, "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise APIError(400, "allowed_token_ids must hold at least one token id", "allowed_token_ids")
        self._check_beam_search()
        return self

    def _check_beam_search(self) -> None:
        """length_penalty finite; with use_beam_search, n within the beam widths the logprobs
        allow, and no field beam search would not apply (vLLM ignores them; here a 400 names it)."""
        if not math.isfinite(self.length_penalty) or abs(self.length_penalty) > MAX_LENGTH_PENALTY:
            raise APIError(
                400,
                f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]",
                "length_penalty",
            )
        if not self.use_beam_search:
            return
        if self.n > MAX_BEAM_WIDTH:
            raise APIError(400, f"n (the beam width) must be at most {MAX_BEAM_WIDTH} with use_beam_search", "n")
        set_fields = {
            "stop": bool(self.stop),
            "stop_token_ids": bool(self.stop_token_ids),
            "logit_bias": bool(self.logit_bias),
            "bad_words": bool(self.bad_words),
            "min_tokens": self.min_tokens > 0,
            "presence_penalty": bool(self.presence_penalty),
            "frequency_penalty": bool(self.frequency_penalty),
            "repetition_penalty": self.repetition_penalty not in (None, 1.0),
            "top_p": self.top_p not in (None, 1.0),
            "top_k": self.top_k not in (None, 0, -1),
            "min_p": bool(self.min_p),
            "response_format": self.response_format is not None and self.response_format.type != "text",
            "structured_outputs": self.structured_outputs is not None,
            **{
                name: getattr(self, name) is not None
                for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
            },
        }
        for name, given in set_fields.items():
            if given:
                raise APIError(
                    400,
                    f"{name} cannot be combined with use_beam_search (beam search does not apply it)",
                    name,
                    "unsupported_field",
                )

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float | None) -> float | None:
        if value is not None and not value >= FLOAT32_TINY:  # exactly the published minimum (NaN too)
            raise ValueError(f"must be at least {FLOAT32_TINY:.3g} (0 in float32 would mask every token)")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s or len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"stop strings must be 1..{MAX_STOP_LENGTH} characters")
        for i, stop in enumerate(stops):  # stop strings go to the engine process as UTF-8
            problem = text_problem(stop)
            if problem:
                raise ValueError(f"stop string {i} {problem}")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, value: list[str] | None) -> list[str] | None:
        if any(not w.strip() or len(w) > MAX_STOP_LENGTH for w in value or []):
            raise ValueError(f"bad words must be 1..{MAX_STOP_LENGTH} characters, not blank")
        return value

    def _logit_bias(self) -> dict[int, float] | None:
        """Keys are token ids written as strings (OpenAI's JSON); values clamped to +-100."""
        if self.logit_bias is None:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.strip().isdigit():
                raise APIError(
                    400, f"logit_bias keys must be token ids (non-negative integers), got {key!r}", "logit_bias"
                )
            if not math.isfinite(bias):
                raise APIError(400, f"logit_bias values must be finite numbers, got {bias!r}", "logit_bias")
            out[int(key)] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, bias))
        return out

    def _structured_outputs(
        self, tool_call_parser: str | None = None, reasoning_parser: str | None = None
    ) -> tuple[str, StructuredOutputsParams] | None:
        """The one grammar the request asks for and the field it used (400 naming the field when
        it is malformed, or when two fields ask). The parsers: see ChatCompletionRequest."""
        asked: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
            asked.append(("response_format", {"json": fmt.json_schema.json_schema}))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            asked.append(("structured_outputs", fields))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            value = getattr(self, name)
            if value is not None:
                asked.append((name, {name.removeprefix("guided_"): value}))
        if not asked:
            return None
        if len(asked) > 1:
            names = ", ".join(name for name, _ in asked)
            raise APIError(400, f"ask for one structured output per request, got {names}", asked[1][0])
        name, fields = asked[0]
        try:  # what goes to the engine must encode: no lone surrogate, no NUL, no endless nesting
            problem = text_problem(json.dumps(fields, ensure_ascii=False, allow_nan=False))
        except (RecursionError, ValueError):
            problem = "is nested too deeply or holds a number JSON cannot write"
        if problem:
            raise APIError(400, f"{name} {problem}", name)
        if isinstance(fields.get("json"), str):  # a schema sent as JSON text: the engine parses it
            try:
                check_json_limits(fields["json"])
            except JSONLimitError as e:
                raise APIError(400, f"{name} {e}", name) from None
        try:
            return name, StructuredOutputsParams(**fields)
        except ValueError as e:
            raise APIError(400, f"{name}: {e}".replace("structured_outputs: ", "", 1), name) from None

    def sampling_params(
        self,
        defaults: SamplingParams,
        max_tokens: int | None,
        logprobs: int | None,
        max_n: int,
        prompt_logprobs: int | None = None,
        max_grammar_bytes: int | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> SamplingParams:
        """`max_grammar_bytes`: the most bytes a structured-output spec may have (--max-grammar-bytes);
        `tool_call_parser`, `reasoning_parser`: the server's --tool-call-parser and --reasoning-parser
        (the format a forced call is written in, and whether reasoning comes first)."""
        if self.n > max_n:
            raise APIError(400, f"n must be at most {max_n}", "n")
        logit_bias = self._logit_bias()
        asked = self._structured_outputs(tool_call_parser, reasoning_parser)
        structured_outputs = None if asked is None else asked[1]
        if asked is not None and max_grammar_bytes is not None:
            name, spec = asked
            size = len(spec.key[1].encode())
            if size > max_grammar_bytes:
                message = (
                    f"{name} is {size} bytes, more than the {max_grammar_bytes} allowed "
                    "(max_grammar_bytes, --max-grammar-bytes)"
                )
                raise APIError(400, message, name)
        try:
            return SamplingParams(
                n=self.n,
                temperature=defaults.temperature if self.temperature is None else self.temperature,
                top_p=defaults.top_p if self.top_p is None else self.top_p,
                top_k=defaults.top_k if self.top_k is None else self.top_k,
                max_tokens=max_tokens,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                logprobs=logprobs,
                repetition_penalty=defaults.repetition_penalty
                if self.repetition_penalty is None
                else self.repetition_penalty,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                min_p=defaults.min_p if self.min_p is None else self.min_p,
                min_tokens=self.min_tokens,
                logit_bias=logit_bias,
                bad_words=self.bad_words,
                structured_outputs=structured_outputs,
                prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                allowed_token_ids=self.allowed_token_ids,
            )
        except ValueError as e:  # SamplingParams' messages start with the field's name
            message = str(e)
            raise APIError(400, message, message.split(" ", 1)[0]) from None


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={"items": MESSAGE_SCHEMA})
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    logprobs: StrictBool = False
    # -1: the whole vocabulary (vLLM's); the bound is the server's --max-logprobs.
    top_logprobs: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: a Jinja chat template of the request's own, rendered only where the server was
    # started with --trust-request-chat-template (a 400 naming the flag otherwise).
    chat_template: ChatTemplateField | None = None
    add_generation_prompt: StrictBool = True
    # Tool calling and reasoning output (vlmserve/api/tool_calling.py, reasoning.py).
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    include_reasoning: StrictBool = True
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM's: the last message left open for the model to continue (needs add_generation_prompt false).
    continue_final_message: StrictBool = False
    # vLLM's: the last message's content comes first in each answer when its role is the
    # answer's (the assistant's with add_generation_prompt, else the last message's own).
    echo: StrictBool = False

    _unsupported: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = UNSUPPORTED_FIELDS | _CHAT_UNSUPPORTED

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:  # vLLM's rule (-1 too)
            raise APIError(400, "when using top_logprobs, logprobs must be set to true", "top_logprobs")
        try:
            check_tool_choice(self.tools, self.tool_choice)
        except ValueError as e:
            message = str(e)
            raise APIError(400, message, message.split(":", 1)[0]) from None
        check_continuation(self.continue_final_message, self.add_generation_prompt)
        if self.use_beam_search and forced_tool_schema(
            self.tools, self.effective_tool_choice, self.parallel_tool_calls
        ):
            message = "tool_choice that forces a call cannot be combined with use_beam_search (it applies no grammar)"
            raise APIError(400, message, "tool_choice", "unsupported_field")
        return self

    @property
    def effective_tool_choice(self) -> ToolChoice:
        return effective_tool_choice(self.tools, self.tool_choice)

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template gets besides the messages: the tools (also with tool_choice
        "none", as vLLM renders them), reasoning_effort, then the request's chat_template_kwargs."""
        kwargs: dict[str, Any] = {}
        if self.tools:
            kwargs["tools"] = [tool.model_dump(exclude_unset=True) for tool in self.tools]
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs | (self.chat_template_kwargs or {})

    def _structured_outputs(
        self, tool_call_parser: str | None = None, reasoning_parser: str | None = None
    ) -> tuple[str, StructuredOutputsParams] | None:
        own = super()._structured_outputs()
        forced = forced_tool_schema(self.tools, self.effective_tool_choice, self.parallel_tool_calls)
        if forced is None:
            return own
        if own is not None:
            raise APIError(
                400, "tool_choice that forces a call cannot be combined with structured outputs", "tool_choice"
            )
        if tool_call_parser == XML_TOOL_CALL_PARSER:  # Qwen3.5's format, as its template writes calls
            thinking = thinking_enabled(self.chat_template_kwargs)
            reasoning = reasons_before_forced_calls(tool_call_parser, reasoning_parser, thinking)
            grammar = forced_tool_grammar(self.tools, self.effective_tool_choice, self.parallel_tool_calls, reasoning)
            return "tools", StructuredOutputsParams(grammar=grammar)
        # No free whitespace: the call is written as json.dumps writes it (", " and ": "), and a
        # model cannot run on in whitespace inside the call (vLLM allows any).
        return "tools", StructuredOutputsParams(json=forced, disable_any_whitespace=True)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    # The bound is the server's --max-logprobs (vLLM's: -1 is not taken here).
    logprobs: int | None = Field(default=None, ge=0, le=INT64_MAX)
    # The prompt first in each choice's text (and, with logprobs, its tokens first in them).
    echo: StrictBool = False

    _unsupported: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = UNSUPPORTED_FIELDS | _COMPLETION_UNSUPPORTED


class TokenizeCompletionRequest(BaseModel):
    """vLLM's POST /tokenize with a prompt: the tokenizer's ids for the text."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True  # Qwen's tokenizers add none either way
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> TokenizeCompletionRequest:
        refuse_unsupported(self.model_extra, {})
        return self


class TokenizeChatRequest(BaseModel):
    """vLLM's POST /tokenize with messages: the prompt's ids as the model gets them, each image's
    placeholder tokens expanded."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={"items": MESSAGE_SCHEMA})
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: ChatTemplateField | None = None  # as in a chat request
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    continue_final_message: StrictBool = False
    # As in a chat request: the items counted as the model would see them.
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> TokenizeChatRequest:
        refuse_unsupported(self.model_extra, UNSUPPORTED_FIELDS)
        check_continuation(self.continue_final_message, self.add_generation_prompt)
        return self


def check_continuation(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """vLLM's rule: a request cannot both leave the last message open and add the generation prompt."""
    if continue_final_message and add_generation_prompt:
        raise APIError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] = Field(max_length=1 << 20)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> DetokenizeRequest:
        refuse_unsupported(self.model_extra, {})
        return self
