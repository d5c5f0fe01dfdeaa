"""The body of POST /v1/responses (OpenAI's Responses API, as vLLM serves it) and what it becomes:
a conversation of input items, rendered as the chat messages the chat endpoint takes, and a chat
request, so that a response's prompt and sampling are exactly the chat endpoint's for the same
conversation.

Input items served (each named `input[i]` in errors):
- a message: {"role": "user" | "system" | "developer" | "assistant", "content": text or parts};
  parts `input_text`, `input_image` (image_url: a URL or data URL; `detail` low / high / auto),
  and an assistant's `output_text` / `refusal`; "developer" is the system role;
- `function_call` (an earlier call: call_id, name, arguments) and `function_call_output`
  (its result: call_id, output), rendered as the assistant's tool_calls and a tool message;
- `reasoning` (an earlier answer's reasoning), rendered as the next assistant message's
  reasoning_content.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, model_validator

from vlmserve.api.protocol import UNSUPPORTED_FIELDS, ChatCompletionRequest, check_text, refuse_unsupported
from vlmserve.api.tool_calling import MAX_TOOLS
from vlmserve.errors import APIError
from vlmserve.multimodal.image import DETAILS
from vlmserve.sampling_params import INT64_MAX

MAX_INPUT_ITEMS = 4096
MAX_METADATA_KEYS = 16  # OpenAI's bounds on metadata
MAX_METADATA_VALUE = 512
# vLLM's sampling fields beyond OpenAI's, taken by a Responses request as by a chat one.
PASSED_TO_CHAT = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "logit_bias",
    "bad_words",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "allowed_token_ids",
    "request_id",
    "return_token_ids",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "structured_outputs",
)
# OpenAI's Responses fields that vlmserve does not serve: refused (400) unless "off".
_OFF = (None,)
RESPONSES_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((None, False), "background responses are not served: the request runs while the client waits"),
    "conversation": (_OFF, "conversations are not stored: continue one with previous_response_id"),
    "prompt": (_OFF, "stored prompt templates are not served"),
    "include": ((None, ()), "no extra output (include) is served: logprobs and encrypted reasoning are not returned"),
    "truncation": ((None, "disabled"), "only truncation 'disabled' is served: a conversation too long is refused"),
    "max_tool_calls": (_OFF, "the calls are not bounded by count (tool_choice and parallel_tool_calls are served)"),
    "top_logprobs": ((None, 0), "output logprobs are not served here (the chat endpoint has them)"),
    "context_management": (_OFF, "context management is not served"),
} | UNSUPPORTED_FIELDS
# Fields a Responses request accepts and ignores, as OpenAI's that change nothing here.
_IGNORED = ("service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "stream_options")
# A chat request's field -> the Responses field it came from (errors name the latter).
_RESPONSES_NAME = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "tools": "tools",
    "tool_choice": "tool_choice",
}


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON that follows `schema`."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    # OpenAI's field is `schema`; pydantic's BaseModel has a `schema` method, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(BaseModel):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Literal["low", "medium", "high"] | None = None


class FunctionTool(BaseModel):
    """A Responses function tool: flat, unlike chat's {"type", "function": {...}}."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    def as_chat(self) -> dict[str, Any]:
        function = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": function}


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)


class ReasoningConfig(BaseModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any] = Field(min_length=1)
    instructions: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, le=1.0)
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool = True
    reasoning: ReasoningConfig | None = None
    store: StrictBool = True
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    stream: StrictBool = False
    metadata: dict[str, str] | None = Field(default=None, max_length=MAX_METADATA_KEYS)
    user: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        extra = {k: v for k, v in (self.model_extra or {}).items() if k not in PASSED_TO_CHAT and k not in _IGNORED}
        refuse_unsupported(extra, RESPONSES_UNSUPPORTED)
        for key, value in (self.metadata or {}).items():
            if len(key) > 64 or len(value) > MAX_METADATA_VALUE:
                raise APIError(
                    400, f"metadata: keys are at most 64 characters, values at most {MAX_METADATA_VALUE}", "metadata"
                )
        for name in ("instructions", "previous_response_id", "user"):
            value = getattr(self, name)
            if value is not None:
                check_text(value, name)
        self.function_tools()  # every tool checked
        return self

    def function_tools(self) -> list[FunctionTool]:
        """The tools, each a function (OpenAI's hosted tools are not served): 400 naming it."""
        tools = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                shown = str(kind)[:40]
                raise APIError(400, f"tools[{i}]: only function tools are served, not {shown!r}", f"tools[{i}].type")
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(x) for x in first["loc"])
                raise APIError(400, f"tools[{i}].{where}: {first['msg']}", f"tools[{i}]") from None
        return tools

    def input_items(self) -> list[dict[str, Any]]:
        """The input as a list of items (a text input: one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        if len(self.input) > MAX_INPUT_ITEMS:
            raise APIError(400, f"input holds {len(self.input)} items, at most {MAX_INPUT_ITEMS}", "input")
        return list(self.input)

    def chat_request(self, items: list[dict[str, Any]], first: int = 0) -> ChatCompletionRequest:
        """The chat request this response runs as: `items` (the conversation, this request's own
        input from index `first` on) as messages, the instructions as the system message first."""
        messages = conversation_messages(items, first)
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        if not messages:
            raise APIError(400, "input holds no message to answer", "input")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_output_tokens,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        tools = self.function_tools()
        if tools:
            body["tools"] = [tool.as_chat() for tool in tools]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise APIError(400, "text.format json_schema needs its schema", "text.format.schema")
            schema = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort in ("low", "medium", "high"):
            body["reasoning_effort"] = effort
        body |= {k: v for k, v in (self.model_extra or {}).items() if k in PASSED_TO_CHAT}
        try:
            return ChatCompletionRequest.model_validate(body)
        except APIError as e:
            raise renamed(e) from None
        except ValidationError as e:
            first_error = e.errors()[0]
            loc = [str(x) for x in first_error["loc"]]
            if not loc:
                raise APIError(400, str(first_error["msg"])) from None
            param = _RESPONSES_NAME.get(loc[0], loc[0])
            raise APIError(400, f"{'.'.join([param, *loc[1:]])}: {first_error['msg']}", param) from None

    @property
    def tool_choice_shown(self) -> Any:
        """tool_choice as a response shows it (OpenAI's default: auto)."""
        if isinstance(self.tool_choice, NamedFunction):
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"


def renamed(e: APIError) -> APIError:
    """A chat request's error named in the Responses fields (the message too, where it starts
    with the chat field's name)."""
    param = e.param.split(".", 1)[0] if e.param else None
    if param in _RESPONSES_NAME and _RESPONSES_NAME[param] != param:
        name = _RESPONSES_NAME[param]
        if e.message.startswith(param):
            e.message = name + e.message[len(param) :]
        e.param = name
    return e


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise APIError(400, f"{where} must be a string", "input")
    return value


def _content_parts(content: object, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: text as it is, parts as chat parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of parts", "input")
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": _text(part.get("text"), f"{at}.text")})  # type: ignore[union-attr]
        elif kind == "refusal":
            parts.append({"type": "text", "text": _text(part.get("refusal"), f"{at}.refusal")})  # type: ignore[union-attr]
        elif kind == "input_image":
            assert isinstance(part, dict)
            if part.get("file_id") is not None:
                raise APIError(
                    400, f"{at}: file_id needs OpenAI's Files API, which is not served: send image_url", "input"
                )
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise APIError(400, f"{at}: input_image needs image_url (a URL or a data URL)", "input")
            detail = part.get("detail", "auto")
            if detail not in DETAILS:
                raise APIError(
                    400, f"{at}: detail must be one of {', '.join(DETAILS)}, got {str(detail)[:40]!r}", "input"
                )
            parts.append({"type": "image_url", "image_url": {"url": url, "detail": detail}})
        elif kind in ("input_file", "input_audio"):
            raise APIError(400, f"{at}: {kind} is not served (text and images are)", "input")
        else:
            shown = str(kind)[:40]
            raise APIError(
                400, f"{at}: unknown part type {shown!r}; served: input_text, input_image, output_text", "input"
            )
    return parts


def _joined_text(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def conversation_messages(items: list[Any], first: int = 0) -> list[dict[str, Any]]:
    """Input items (output items of earlier responses among them) as chat messages. An assistant's
    reasoning, text and calls that follow one another make one assistant message, as the chat
    endpoint's answer is one: text joins a message that holds only reasoning, a call joins any
    assistant message before it. Errors name the item as `input[i]`, counted from `first` (the
    request's own items; earlier ones are the stored conversation's)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i - first}]" if i >= first else "the stored conversation"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", "input")
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            given = item.get("role")
            role = ROLES.get(given) if isinstance(given, str) else None
            if role is None:
                shown = str(given)[:40]
                raise APIError(
                    400, f"{where}.role must be user, system, developer or assistant, not {shown!r}", "input"
                )
            content = _content_parts(item.get("content"), where)
            if role != "assistant":
                messages.append({"role": role, "content": content})
            elif last is not None and not last["content"] and "tool_calls" not in last:
                last["content"] = _joined_text(content)
            else:
                messages.append({"role": "assistant", "content": _joined_text(content)})
        elif kind == "function_call":
            call = {
                "id": _text(item.get("call_id"), f"{where}.call_id"),
                "type": "function",
                "function": {
                    "name": _text(item.get("name"), f"{where}.name"),
                    "arguments": _text(item.get("arguments"), f"{where}.arguments"),
                },
            }
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _content_parts(output, where)
            call_id = _text(item.get("call_id"), f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise APIError(400, f"{where}.content must be a list of reasoning_text parts", "input")
            texts = [
                _text(part.get("text") if isinstance(part, dict) else None, f"{where}.content[{j}].text")
                for j, part in enumerate(parts)
            ]
            messages.append({"role": "assistant", "content": "", "reasoning_content": "\n".join(texts)})
        else:
            shown = str(kind)[:40]
            raise APIError(
                400,
                f"{where}: item type {shown!r} is not served; served: message, function_call, "
                "function_call_output, reasoning",
                "input",
            )
    return messages
