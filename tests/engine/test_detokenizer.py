from __future__ import annotations

from pathlib import Path

import pytest

from vlmserve.engine.detokenizer import IncrementalDetokenizer
from vlmserve.sampling_params import SamplingParams
from vlmserve.tokenizer import Tokenizer
from vlmserve.tools.tiktoken_to_hf import bytes_to_unicode


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_dir)


def stream(tok: Tokenizer, ids: list[int], params: SamplingParams) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, params)
    seen = []
    for i, token in enumerate(ids):
        if d.update([token], finished=i == len(ids) - 1) is not None:
            seen.append(d.visible_text(True))
            break
        seen.append(d.visible_text(i == len(ids) - 1))
    return seen, d


def test_never_shows_half_a_character(tok: Tokenizer) -> None:
    text = "naïve 你好 🙂 done"
    # Byte-level tokens: every byte its own token, so multi-byte characters span several.
    byte_tokens = [tok.token_to_id(bytes_to_unicode()[b]) for b in text.encode()]
    seen, d = stream(tok, byte_tokens, SamplingParams())
    assert all("\ufffd" not in s for s in seen)
    assert all(seen[i + 1].startswith(seen[i]) for i in range(len(seen) - 1))
    assert d.text == text == tok.decode(byte_tokens)


def test_unfinished_bytes_at_the_end_decode_like_a_full_decode(tok: Tokenizer) -> None:
    ids = tok.encode("ok ") + [tok.token_to_id(bytes_to_unicode()[0xE4])]
    _, d = stream(tok, ids, SamplingParams())
    assert d.text == tok.decode(ids) == "ok \ufffd"


def test_stop_string_across_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hello there. The END is here")
    seen, d = stream(tok, ids, SamplingParams(stop=["END"]))
    assert d.stopped_by == "END"
    assert d.text == "Hello there. The "
    # Held back while "E" or "EN" might start "END": nothing past the stop point was ever shown.
    assert all("Hello there. The ".startswith(s) for s in seen)
    # Tokens: "Hello", " there", ".", " The", " END": each view holds back len("END") - 1 chars.
    assert seen == ["Hel", "Hello the", "Hello ther", "Hello there. T", "Hello there. The "]
    _, d = stream(tok, ids, SamplingParams(stop=["END"], include_stop_str_in_output=True))
    assert d.text == "Hello there. The END"


def test_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("a<|im_end|>b")
    assert stream(tok, ids, SamplingParams())[1].text == "ab"
    assert stream(tok, ids, SamplingParams(skip_special_tokens=False))[1].text == "a<|im_end|>b"
