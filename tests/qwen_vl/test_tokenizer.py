"""QwenVLTokenizer against the reference's values and against tiktoken built from the same qwen.tiktoken."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest
import tiktoken
from tokenizers.decoders import DecodeStream

from vlmserve.api.detokenizer import IncrementalDetokenizer
from vlmserve.families.qwen_vl.chat_format import make_context
from vlmserve.families.qwen_vl.tokenizer import IMAGE_ST, QwenVLTokenizer, cache_dir
from vlmserve.sampling_params import SamplingParams
from vlmserve.tools.tiktoken_to_hf import load_tiktoken_ranks

# The reference's split pattern and special tokens, as the remote QWenTokenizer builds its tiktoken.Encoding.
PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SEED_SPECIALS = (
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    + tuple(f"<|extra_{i}|>" for i in range(205))
    + ("<ref>", "</ref>", "<box>", "</box>", "<quad>", "</quad>", "<img>", "</img>", "<imgpad>")
)
DEMO_URL = "https://qianwen-res.oss-cn-beijing.aliyuncs.com/Qwen-VL/assets/demo.jpeg"


@pytest.fixture(scope="module")
def reference(qwen_vl_dir: Path) -> tiktoken.Encoding:
    ranks = load_tiktoken_ranks(qwen_vl_dir / "qwen.tiktoken")
    specials = {token: len(ranks) + i for i, token in enumerate(SEED_SPECIALS)}
    return tiktoken.Encoding("Qwen", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def test_special_token_ids(qwen_vl_tokenizer: QwenVLTokenizer) -> None:
    tok = qwen_vl_tokenizer
    # 151643 BPE ranks, then 3 + 205 + 9 = 217 special tokens.
    assert tok.vocab_size == 151643 + 217 == 151860
    assert [tok.token_to_id(t) for t in SEED_SPECIALS] == list(range(151643, 151860))
    assert (tok.eod_id, tok.im_start_id, tok.im_end_id) == (151643, 151644, 151645)
    assert tok.token_to_id("<|extra_0|>") == 151646 and tok.token_to_id("<|extra_204|>") == 151850
    ids = {t: tok.token_to_id(t) for t in ("<ref>", "</ref>", "<box>", "</box>", "<quad>", "</quad>")}
    assert list(ids.values()) == [151851, 151852, 151853, 151854, 151855, 151856]
    assert (tok.img_start_id, tok.img_end_id, tok.img_pad_id) == (151857, 151858, 151859)
    assert tok.eos_token_id == 151643
    assert tok.backend.get_vocab_size() == 151860
    with pytest.raises(ValueError, match="no token"):
        tok.token_to_id("<nope>")


@pytest.mark.parametrize(
    ("text", "ids"),
    [("system", [8948]), ("assistant", [77091]), ("user", [872]), ("\n", [198])]
    + [("ai", [2143]), ("tool", [14172]), ("function", [1688])],
)
def test_seed_single_tokens(qwen_vl_tokenizer: QwenVLTokenizer, text: str, ids: list[int]) -> None:
    assert qwen_vl_tokenizer.encode(text) == ids


def _random_text(rng: random.Random) -> str:
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCXYZ",
        "0123456789",
        " \t\n\r  \n\n",
        "'s 't 're 've 'm 'll 'd",
        '!@#$%^&*()_+-=[]{};:,.<>/?|\\"`~',
        "你好世界这是什么图中一名年轻女子在沙滩上",
        "こんにちはカタカナ",
        "Привет мир",
        "مرحبا بالعالم",
        "é\u0301e\u0301\u0308\u0338ﬁ한국어",
        "😀🐕👍🏽",
        "<|im_start|><|im_end|><|endoftext|><ref></ref><box></box><imgpad><|extra_7|>",
    ]
    pieces = []
    for _ in range(rng.randint(1, 12)):
        pool = rng.choice(pools)
        if pool.startswith("<|im_start|>") and rng.random() < 0.7:
            pieces.append(rng.choice(SEED_SPECIALS[:3] + SEED_SPECIALS[-9:-3] + ("<imgpad>", "<|extra_7|>")))
        else:
            pieces.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
    return "".join(pieces)


def test_matches_tiktoken_on_random_text(qwen_vl_tokenizer: QwenVLTokenizer, reference: tiktoken.Encoding) -> None:
    rng = random.Random(0)
    for _ in range(300):
        text = _random_text(rng).replace("<img>", "").replace("</img>", "")
        nfc = unicodedata.normalize("NFC", text)
        # The remote tokenizer's default (all special tokens allowed) and make_context's (IMAGE_ST only).
        assert qwen_vl_tokenizer.encode(text) == reference.encode(nfc, allowed_special="all"), text
        expected = reference.encode(nfc, allowed_special=set(IMAGE_ST), disallowed_special=())
        assert qwen_vl_tokenizer.encode(text, allowed_special=set(IMAGE_ST)) == expected, text
        assert qwen_vl_tokenizer.decode(qwen_vl_tokenizer.encode(text), skip_special_tokens=False) == nfc


def test_nfc_and_disallowed_special_text(qwen_vl_tokenizer: QwenVLTokenizer, reference: tiktoken.Encoding) -> None:
    tok = qwen_vl_tokenizer
    assert tok.encode("cafe\u0301") == tok.encode("café")
    assert tok.encode("<|im_start|>") == [151644]
    as_text = tok.encode("<|im_start|>", allowed_special=set(IMAGE_ST))
    assert 151644 not in as_text and as_text == reference.encode_ordinary("<|im_start|>")
    assert tok.encode("<box>(1,2),(3,4)</box>", allowed_special=set())[0] != 151853
    with pytest.raises(ValueError, match="not special tokens"):
        tok.encode("x", allowed_special={"<nope>"})


def test_image_span_as_the_seed_shows(qwen_vl_tokenizer: QwenVLTokenizer, reference: tiktoken.Encoding) -> None:
    tok = qwen_vl_tokenizer
    text = f"Picture 1: <img>{DEMO_URL}</img>\n这是什么"
    plain = reference.encode(text, allowed_special=set(SEED_SPECIALS[-9:]))
    ids = tok.encode(text)
    i, j = ids.index(151857), ids.index(151858)
    assert j - i - 1 == 256
    span = ids[i + 1 : j]
    # One token per byte, the id being the byte value, then <imgpad>.
    assert span[: len(DEMO_URL)] == list(DEMO_URL.encode())
    assert span[len(DEMO_URL) :] == [151859] * (256 - len(DEMO_URL))
    assert bytes(x for x in span if x != tok.img_pad_id).decode("utf-8") == DEMO_URL
    # Everything outside the span is the plain tiktoken encoding.
    pi, pj = plain.index(151857), plain.index(151858)
    assert ids[:i] + ids[j + 1 :] == plain[:pi] + plain[pj + 1 :]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == f"Picture 1: {DEMO_URL}\n这是什么"


def test_image_span_limits(qwen_vl_tokenizer: QwenVLTokenizer) -> None:
    tok = qwen_vl_tokenizer
    url = "/data/" + "é" * 125  # 6 + 250 = 256 bytes: no padding at all
    ids = tok.encode(f"<img>{url}</img>")
    assert len(ids) == 258 and tok.img_pad_id not in ids
    assert tok.decode(ids, skip_special_tokens=False) == f"<img>{url}</img>"
    empty = tok.encode("<img></img>")
    assert empty == [151857, *[151859] * 256, 151858]
    assert tok.decode(empty, skip_special_tokens=False) == "<img></img>"
    with pytest.raises(ValueError, match="257 bytes long; Qwen-VL allows at most 256 bytes"):
        tok.encode(f"<img>{url}x</img>")
    with pytest.raises(ValueError, match="unclosed <img>"):
        tok.encode("<img>a.jpg")
    with pytest.raises(ValueError, match="special tokens are not allowed inside"):
        tok.encode("<img>a<ref>b</ref>.jpg</img>")
    # A stray </img> is text with a special token, as in the remote code.
    assert tok.encode("a</img>")[-1] == 151858


def test_decode_seed_generation(qwen_vl_tokenizer: QwenVLTokenizer) -> None:
    tok = qwen_vl_tokenizer
    new_tokens = [17, 10, 17, 28, 19, 151645, 151643]
    assert [tok.token_bytes(t) for t in new_tokens] == [b"2", b"+", b"2", b"=", b"4", b"<|im_end|>", b"<|endoftext|>"]
    assert tok.decode(new_tokens) == "2+2=4"
    assert tok.decode(new_tokens, skip_special_tokens=False) == "2+2=4<|im_end|><|endoftext|>"
    grounding = tok.encode("<ref>击掌</ref><box>(517,508),(589,611)</box>")
    assert tok.decode(grounding, skip_special_tokens=False) == "<ref>击掌</ref><box>(517,508),(589,611)</box>"
    # A model writing bytes between <img> and </img> that are no URL span decodes them as tokens.
    odd = [151857, 9707, 151858]
    assert tok.decode(odd, skip_special_tokens=False) == "<img>Hello</img>"
    assert tok.decode([151857, 9707]) == "Hello"  # unclosed in output: no error


def test_backend_streams_like_decode(qwen_vl_tokenizer: QwenVLTokenizer) -> None:
    tok = qwen_vl_tokenizer
    ids = tok.encode("图中是一名年轻女子 😀 playing<|im_end|>")
    stream = DecodeStream(skip_special_tokens=True)
    text = "".join(piece for t in ids if (piece := stream.step(tok.backend, t)))
    assert text == tok.decode(ids) == "图中是一名年轻女子 😀 playing"
    detok = IncrementalDetokenizer(tok, SamplingParams(stop=["女子"]))  # type: ignore[arg-type]
    assert detok.update(ids, finished=False) == "女子"
    assert detok.text == "图中是一名年轻"


def test_cached_tokenizer_json(qwen_vl_dir: Path, qwen_vl_tokenizer: QwenVLTokenizer, qwen_vl_cache: Path) -> None:
    assert cache_dir() == qwen_vl_cache
    cached = list(qwen_vl_cache.glob("qwen-vl-tokenizer-v*.json"))
    assert len(cached) == 1
    assert json.loads(cached[0].read_text())["added_tokens"][-1]["content"] == "<imgpad>"
    again = QwenVLTokenizer(qwen_vl_dir)
    assert again.encode("Picture 1: <img>a.jpg</img>\n") == qwen_vl_tokenizer.encode("Picture 1: <img>a.jpg</img>\n")


def test_corrupt_cache_is_rebuilt(
    qwen_vl_dir: Path,
    qwen_vl_tokenizer: QwenVLTokenizer,
    qwen_vl_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (good,) = qwen_vl_cache.glob("qwen-vl-tokenizer-v*.json")
    cached = tmp_path / good.name
    cached.write_text("{")
    monkeypatch.setenv("VLMSERVE_CACHE", str(tmp_path))
    assert (
        QwenVLTokenizer(qwen_vl_dir).encode("hello world") == qwen_vl_tokenizer.encode("hello world") == [14990, 1879]
    )
    assert cached.read_bytes() == good.read_bytes()


def test_missing_vocabulary(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no qwen.tiktoken"):
        QwenVLTokenizer(tmp_path)


def test_apply_chat_template(qwen_vl_tokenizer: QwenVLTokenizer) -> None:
    tok = qwen_vl_tokenizer
    messages = [
        {"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": "1+1=?"},
        {"role": "assistant", "content": "1+1=2"},
        {"role": "user", "content": "how about 2+2"},
    ]
    raw_text, _ = make_context(tok, "how about 2+2", [("1+1=?", "1+1=2")], "you are a helpful assistant")
    assert tok.apply_chat_template(messages) == raw_text
    assert tok.apply_chat_template(messages[1:], system="be brief").startswith("<|im_start|>system\nbe brief<|im_end|>")
    assert tok.chat_template_source is None
    custom = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert (
        tok.apply_chat_template(messages[:2], chat_template=custom)
        == "system: you are a helpful assistant\nuser: 1+1=?\n"
    )
    with pytest.raises(ValueError, match="unknown chat options"):
        tok.apply_chat_template(messages, add_vision_id=True)
    with pytest.raises(ValueError, match="could not render"):
        tok.apply_chat_template(messages, chat_template="{{ raise_exception('no') }}")
