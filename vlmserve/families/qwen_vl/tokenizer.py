"""The Qwen-VL-Chat tokenizer, natively: the checkpoint's qwen.tiktoken ranks with the
remote code's special tokens and its image-span encoding, no trust_remote_code.

Vocabulary: the 151,643 BPE ranks of qwen.tiktoken, then 217 special tokens in this order

    151643 <|endoftext|>   151644 <|im_start|>   151645 <|im_end|>   151646..151850 <|extra_0..204|>
    151851 <ref>  151852 </ref>  151853 <box>  151854 </box>  151855 <quad>  151856 </quad>
    151857 <img>  151858 </img>  151859 <imgpad>

Encoding NFC-normalises the whole text, splits out the special tokens that are allowed (all of
them unless told otherwise, the remote tokenizer's default) and byte-pair encodes the rest with
the reference's split pattern, exactly as tiktoken does. Then every `<img>URL</img>` becomes
<img>, one token per byte of the URL's UTF-8 whose id IS the byte value (the remote code maps
each byte b through `decoder.get(b)`, so byte 0x68 'h' is token id 104, not the BPE token "h"),
<imgpad> up to 256 positions, </img>:

    "<img>a.jpg</img>" -> [151857, 97, 46, 106, 112, 103, 151859 x 251, 151858]   (258 ids)

The model overwrites the 256 positions with the image's features; the ids only carry the URL to
whoever loads the image. Decoding turns such a span back into `<img>URL</img>`.

Text is byte-pair encoded with `tokenizers` (the tokenizer.json vlmserve.tools.tiktoken_to_hf
derives from qwen.tiktoken, which is tiktoken-exact); the same object is `backend`, what the
engine's incremental detokenizer streams with. Deriving it takes about two seconds, so it is
cached as a tokenizer.json under $VLMSERVE_CACHE (default ~/.cache/vlmserve) keyed by the hash
of qwen.tiktoken.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import unicodedata
from collections.abc import Collection, Iterable
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from tokenizers import Tokenizer as HFTokenizer

from vlmserve.families.qwen_vl.chat_format import chat_prompt, from_list_format, to_list_format
from vlmserve.families.qwen_vl.tokens import (
    ALL_SPECIAL_TOKENS,
    BOX_END,
    BOX_START,
    ENDOFTEXT,
    IM_END,
    IM_START,
    IMAGE_END,
    IMAGE_PAD,
    IMAGE_ST,
    IMAGE_START,
    IMG_TOKEN_SPAN,
    QUAD_END,
    QUAD_START,
    REF_END,
    REF_START,
)
from vlmserve.model_files import read_json
from vlmserve.tokenizer import byte_level_token_bytes, compile_chat_template, render_chat_template

# Bump when the cached tokenizer.json's layout changes.
_CACHE_VERSION = 1

AllowedSpecial = Literal["all"] | Collection[str]


def cache_dir() -> Path:
    return Path(os.environ.get("VLMSERVE_CACHE", Path.home() / ".cache" / "vlmserve"))


def _build_backend(tiktoken_file: Path, data: bytes) -> HFTokenizer:
    """The byte-level BPE tokenizer equivalent to tiktoken on `data` (qwen.tiktoken's bytes), with
    the 217 special tokens added at their ids; read from the cache when it was built before."""
    from vlmserve.tools.tiktoken_to_hf import build_tokenizer_json, load_tiktoken_ranks

    digest = hashlib.sha256(data).hexdigest()[:20]
    cached = cache_dir() / f"qwen-vl-tokenizer-v{_CACHE_VERSION}-{digest}.json"
    if cached.is_file():
        try:
            return HFTokenizer.from_file(str(cached))
        except Exception:  # a truncated or foreign file: rebuild it
            pass
    ranks = load_tiktoken_ranks(tiktoken_file)
    added = [(len(ranks) + i, token, True) for i, token in enumerate(ALL_SPECIAL_TOKENS)]
    text = json.dumps(build_tokenizer_json(ranks, added), ensure_ascii=False)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cached.parent, prefix=cached.name, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, cached)
    except OSError:  # a read-only cache only costs the rebuild next time
        pass
    return HFTokenizer.from_str(text)


class QwenVLTokenizer:
    """Same public interface as vlmserve.tokenizer.Tokenizer, plus the remote QWenTokenizer's
    names the chat format uses (im_start_id, img_pad_id, IMAGE_ST, from_list_format, ...)."""

    IMAGE_ST = IMAGE_ST
    image_start_tag, image_end_tag, image_pad_tag = IMAGE_START, IMAGE_END, IMAGE_PAD
    ref_start_tag, ref_end_tag = REF_START, REF_END
    box_start_tag, box_end_tag = BOX_START, BOX_END
    quad_start_tag, quad_end_tag = QUAD_START, QUAD_END

    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        tiktoken_file = model_dir / "qwen.tiktoken"
        if not tiktoken_file.is_file():
            raise FileNotFoundError(f"{model_dir}: no qwen.tiktoken (the Qwen-VL-Chat vocabulary)")
        self.config = read_json(model_dir / "tokenizer_config.json")
        generation = read_json(model_dir / "generation_config.json")
        # make_context's budget for system + history, in tokens.
        self.max_window_size = int(generation.get("max_window_size", 6144))
        self._tokenizer = _build_backend(tiktoken_file, tiktoken_file.read_bytes())
        num_ranks = self._tokenizer.get_vocab_size(with_added_tokens=False)
        self.special_tokens = {token: num_ranks + i for i, token in enumerate(ALL_SPECIAL_TOKENS)}
        for token, token_id in self.special_tokens.items():
            if self._tokenizer.token_to_id(token) != token_id:
                raise ValueError(f"tokenizer build is inconsistent: {token} is not id {token_id}")
        self.vocab_size = num_ranks + len(ALL_SPECIAL_TOKENS)
        self.eod_id = self.special_tokens[ENDOFTEXT]
        self.im_start_id = self.special_tokens[IM_START]
        self.im_end_id = self.special_tokens[IM_END]
        self.img_start_id = self.special_tokens[IMAGE_START]
        self.img_end_id = self.special_tokens[IMAGE_END]
        self.img_pad_id = self.special_tokens[IMAGE_PAD]
        # Qwen-VL-Chat has no Jinja chat template: its chat format is make_context (chat_format.py).
        # apply_chat_template(chat_template=...) still renders a template the caller gives.
        self.chat_template_source: str | None = None
        self._pre_tokenizer = self._tokenizer.pre_tokenizer
        self._model = self._tokenizer.model
        self._any_special = re.compile("|".join(map(re.escape, ALL_SPECIAL_TOKENS)))

    @property
    def backend(self) -> HFTokenizer:
        """A `tokenizers.Tokenizer` with the same ids (special tokens marked special), for
        DecodeStream. It does not expand <img> spans: decode() does."""
        return self._tokenizer

    # -- encoding ---------------------------------------------------------------------------------

    def _encode_ordinary(self, text: str) -> list[int]:
        """BPE of text in which nothing is special (tiktoken's encode_ordinary). Runs the
        pre-tokenizer and the model directly, past the added-token matching of encode()."""
        assert self._pre_tokenizer is not None
        return [t.id for piece, _ in self._pre_tokenizer.pre_tokenize_str(text) for t in self._model.tokenize(piece)]

    def _special_pattern(self, allowed_special: AllowedSpecial) -> re.Pattern[str] | None:
        if allowed_special == "all":
            return self._any_special
        allowed = [t for t in ALL_SPECIAL_TOKENS if t in allowed_special]
        unknown = set(allowed_special) - set(allowed)
        if unknown:
            raise ValueError(f"not special tokens of this tokenizer: {sorted(unknown)}")
        return re.compile("|".join(map(re.escape, allowed))) if allowed else None

    def encode(self, text: str, allowed_special: AllowedSpecial = "all") -> list[int]:
        """Token ids of `text`: special tokens named in `allowed_special` map to their ids, any
        other special token's text is ordinary text (the remote tokenizer's disallowed_special=()).
        Every <img>...</img> becomes the 258-id span described in the module docstring; an <img>
        without its </img> or a URL over 256 bytes is a ValueError."""
        text = unicodedata.normalize("NFC", text)
        pattern = self._special_pattern(allowed_special)
        ids: list[int] = []
        start = 0
        for match in pattern.finditer(text) if pattern is not None else ():
            ids.extend(self._encode_ordinary(text[start : match.start()]))
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        ids.extend(self._encode_ordinary(text[start:]))
        return self._encode_image_spans(ids)

    def _encode_image_spans(self, ids: list[int]) -> list[int]:
        if self.img_start_id not in ids:
            return ids
        out: list[int] = []
        end = 0
        for start, stop in self._closed_spans(ids, strict=True):
            out.extend(ids[end:start])
            inner = ids[start + 1 : stop]
            if any(t in self._special_ids for t in inner):
                raise ValueError("special tokens are not allowed inside <img>...</img>: it holds a path or URL")
            url = b"".join(self.token_bytes(t) for t in inner)
            if len(url) > IMG_TOKEN_SPAN:
                raise ValueError(
                    f"the image reference in <img>...</img> is {len(url)} bytes long; Qwen-VL allows at most "
                    f"{IMG_TOKEN_SPAN} bytes (UTF-8), the image's {IMG_TOKEN_SPAN} positions: pass a shorter path "
                    "or URL, or the image itself"
                )
            # NOTE: byte b becomes token id b (the remote code's decoder.get(b)), not the BPE token for b.
            out += [self.img_start_id, *url, *[self.img_pad_id] * (IMG_TOKEN_SPAN - len(url)), self.img_end_id]
            end = stop + 1
        out.extend(ids[end:])
        return out

    def _closed_spans(self, ids: list[int], strict: bool) -> Iterable[tuple[int, int]]:
        """(index of <img>, index of its </img>) for each span, the remote _replace_closed_tag's
        pairing: each <img> closes at the next </img>. An unclosed <img> raises when `strict`,
        else ends the iteration."""
        end = 0
        while True:
            try:
                start = ids.index(self.img_start_id, end)
            except ValueError:
                return
            try:
                stop = ids.index(self.img_end_id, start)
            except ValueError:
                if strict:
                    raise ValueError(f"unclosed {IMAGE_START}: every {IMAGE_START} needs its {IMAGE_END}") from None
                return
            yield start, stop
            end = stop + 1

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self.special_tokens.values())

    # -- decoding ---------------------------------------------------------------------------------

    def image_span_url(self, inner: list[int]) -> str | None:
        """The URL a span's 256 inner ids carry (bytes as ids, then <imgpad>), or None when they
        are not such a sequence (not bytes, not UTF-8, a byte after the padding)."""
        try:
            n = inner.index(self.img_pad_id)
        except ValueError:
            n = len(inner)
        if any(t != self.img_pad_id for t in inner[n:]) or any(not 0 <= t < 256 for t in inner[:n]):
            return None
        try:
            return bytes(inner[:n]).decode("utf-8")
        except UnicodeDecodeError:
            return None

    def _decode_image_spans(self, ids: list[int]) -> list[int]:
        out: list[int] = []
        end = 0
        for start, stop in self._closed_spans(ids, strict=False):
            url = self.image_span_url(ids[start + 1 : stop])
            out.extend(ids[end:start])
            if url is None:  # not a URL span (model output between the tags, say): decoded as it is
                out.extend(ids[start : stop + 1])
            else:
                out += [self.img_start_id, *self._encode_ordinary(url), self.img_end_id]
            end = stop + 1
        out.extend(ids[end:])
        return out

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; an <img> span of byte ids reads `<img>URL</img>` (just the URL with
        skip_special_tokens, which drops every id from <|endoftext|> on, as the remote code does)."""
        ids = list(token_ids)
        if self.img_start_id in ids:
            ids = self._decode_image_spans(ids)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a BPE token stands for, or a special token's text."""
        return byte_level_token_bytes(self._tokenizer, token_id, self._special_ids)

    def token_to_id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"the tokenizer has no token {token!r}")
        return token_id

    @property
    def eos_token_id(self) -> int:
        """<|endoftext|>, generation_config.json's eos_token_id. Chat turns end at <|im_end|>:
        chat_format.STOP_WORDS."""
        return self.eod_id

    # -- chat ---------------------------------------------------------------------------------------

    def from_list_format(self, list_format: list[dict[str, Any]]) -> str:
        return from_list_format(list_format)

    def to_list_format(self, text: str) -> list[dict[str, str]]:
        return to_list_format(text)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The make_context prompt text of `messages` (chat_format.chat_prompt; kwargs: system,
        max_window_size), or, given `chat_template`, that Jinja template rendered."""
        if chat_template is not None:
            return render_chat_template(
                compile_chat_template(chat_template),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                eos_token=ENDOFTEXT,
                **kwargs,
            )
        unknown = {k for k, v in kwargs.items() if v is not None} - {"system", "max_window_size"}
        if unknown:
            raise ValueError(
                f"unknown chat options {sorted(unknown)} for Qwen-VL-Chat; supported: system, max_window_size"
            )
        return chat_prompt(self, messages, add_generation_prompt, **kwargs).text
