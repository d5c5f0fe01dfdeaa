"""The checkpoint's tokenizer (tokenizer.json through `tokenizers`) and its chat template."""

from __future__ import annotations

import functools
import json
from collections.abc import Container
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from vlmserve.model_files import read_json


def load_chat_template(model_dir: Path) -> str | None:
    """The template in the order transformers looks: chat_template.jinja, chat_template.json
    (the processor's), then tokenizer_config.json."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = read_json(model_dir / "chat_template.json").get("chat_template")
    if template is None:
        template = read_json(model_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_tool_chat_template(model_dir: Path) -> str | None:
    """The tokenizer's own template (chat_template.jinja, else tokenizer_config.json's): the one
    vLLM renders a request with tools in, instead of the processor's chat_template.json.
    Qwen2.5-VL-*-Instruct publish the Qwen2.5 template with tools there, and a vision template
    without them in chat_template.json."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = read_json(model_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("tool_use") or named.get("default")
    return template if isinstance(template, str) else None


def read_chat_template(value: str) -> str:
    """vLLM's --chat-template: the path of a file holding a Jinja chat template, or the template
    itself (text with a `{`, `}` or a line break in it, that names no file). ValueError when it
    looks like a path but no file can be read there, or the template does not parse (its line)."""
    path = Path(value).expanduser()
    try:
        source = path.read_text(encoding="utf-8") if path.is_file() else None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{value}: cannot read the chat template file: {e}") from None
    if source is None:
        if not any(ch in value for ch in "{}\n"):
            raise ValueError(f"{value}: no such file (a template given inline holds Jinja: {{ or }})")
        source = value
    compile_chat_template(source)
    return source


def template_variables(source: str) -> set[str]:
    """The names a template reads from its context (its arguments: messages, tools, ...)."""
    compile_chat_template(source)  # a ValueError naming the line where it does not parse
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    return set(jinja2.meta.find_undeclared_variables(env.parse(source)))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template ready to render; ValueError naming the line where it does not parse."""
    try:
        return _compiled_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not parse: line {e.lineno}: {e.message}") from None


# Templates a server renders: its model's, its --chat-template, and those requests bring (where
# it trusts them); the last one compiled of each kept, a few at most.
@functools.lru_cache(maxsize=16)
def _compiled_template(source: str) -> jinja2.Template:
    # The environment transformers renders chat templates in: sandboxed, trim_blocks and
    # lstrip_blocks, loop controls, tojson without ASCII escaping, raise_exception().
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _template_line(error: BaseException) -> int | None:
    """The template line being rendered when `error` was raised (jinja maps its frames back to
    the template's lines, under the file name "<template>"), if it was raised there."""
    line = None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def render_chat_template(template: jinja2.Template, **context: Any) -> str:
    """`template` rendered; ValueError naming the template line when it fails: its own error
    (raise_exception, an undefined value, the sandbox refusing an operation), or Python's on a
    value of the wrong type (not echoed: it can name internals)."""
    try:
        return template.render(**context)
    except jinja2.exceptions.TemplateError as e:
        line = _template_line(e)
        where = "" if line is None else f" (template line {line})"
        raise ValueError(f"the chat template could not render these messages: {e}{where}") from None
    except (TypeError, LookupError, AttributeError, ArithmeticError) as e:
        line = _template_line(e)
        if line is None:
            raise
        raise ValueError(
            f"the chat template could not render these messages and chat_template_kwargs ({type(e).__name__} at "
            f"template line {line}): a value has the wrong type or is out of range"
        ) from None


@functools.cache
def _byte_decoder() -> dict[str, int]:
    from vlmserve.tools.tiktoken_to_hf import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


@functools.cache
def _byte_table() -> dict[int, int | None]:
    """str.translate's table from a byte-level token's characters to its bytes as latin-1 code
    points; the other latin-1 characters are dropped (and encode(errors="ignore") drops the rest),
    as the byte decoder skips characters it does not know."""
    table: dict[int, int | None] = {ord(ch): b for ch, b in _byte_decoder().items()}
    for code in range(256):
        table.setdefault(code, None)
    return table


def byte_level_token_bytes(backend: HFTokenizer, token_id: int, added: Container[int]) -> bytes:
    """The raw bytes a byte-level BPE token stands for; an added (special) token's text."""
    token = backend.id_to_token(token_id)
    if token is None:
        return b""
    if token_id in added:
        return token.encode()
    # One C-level pass (whole-vocabulary logprobs decode every token).
    return token.translate(_byte_table()).encode("latin-1", errors="ignore")


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json")
        self._tokenizer = HFTokenizer.from_file(str(tokenizer_file))
        self.config = read_json(model_dir / "tokenizer_config.json")
        self.chat_template_source = load_chat_template(model_dir)
        self.tool_chat_template_source = load_tool_chat_template(model_dir) or self.chat_template_source
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        # Read once: building the map on every token_bytes call made whole-vocabulary logprobs slow.
        self._added_ids = frozenset(self._tokenizer.get_added_tokens_decoder())

    @property
    def backend(self) -> HFTokenizer:
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        # Special tokens written in the text (<|im_start|>, <|image_pad|>, ...) map to their ids,
        # as transformers does for Qwen (split_special_tokens=False). Qwen adds no BOS.
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (byte-level BPE), or an added token's text."""
        return byte_level_token_bytes(self._tokenizer, token_id, self._added_ids)

    def token_to_id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"the tokenizer has no token {token!r}")
        return token_id

    def _special_token(self, key: str) -> str | None:
        value = self.config.get(key)
        if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
            value = value.get("content")
        return value if isinstance(value, str) else None

    @cached_property
    def eos_token_id(self) -> int | None:
        eos = self._special_token("eos_token")
        return self._tokenizer.token_to_id(eos) if eos else None

    @cached_property
    def _chat_template(self) -> jinja2.Template:
        if self.chat_template_source is None:
            raise ValueError("this checkpoint has no chat template; pass chat_template= or use generate()")
        return compile_chat_template(self.chat_template_source)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        template = compile_chat_template(chat_template) if chat_template else self._chat_template
        special = {k: self._special_token(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return render_chat_template(
            template, messages=messages, add_generation_prompt=add_generation_prompt, **special, **kwargs
        )


class AnyTokenizer(Protocol):
    """What the engine, the server and the entrypoints use of a family's tokenizer (Tokenizer above
    for tokenizer.json checkpoints; a family may bring its own with the same interface)."""

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` tokenizer that decodes (the detokenizer streams through it)."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str: ...
