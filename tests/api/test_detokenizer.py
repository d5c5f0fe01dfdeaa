from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from vlmserve.api.detokenizer import IncrementalDetokenizer
from vlmserve.api.output_processor import OutputProcessor
from vlmserve.ipc.contracts import EngineCoreOutput
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


def one_token(tok: Tokenizer, piece: str) -> int:
    """The id of the single token that `piece` encodes to (asserted, so a test's premise holds)."""
    ids = tok.encode(piece)
    assert len(ids) == 1 and tok.decode(ids) == piece, (piece, ids)
    return ids[0]


def byte_token(tok: Tokenizer, byte: int) -> int:
    return tok.token_to_id(bytes_to_unicode()[byte])


def shown_after_each_token(texts: list[str], holdback: int) -> list[str]:
    """What a stream may show after each token when the text so far is texts[i]: all but the
    last `holdback` characters (they could begin a stop string)."""
    return [t[: max(0, len(t) - holdback)] for t in texts]


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


def test_stop_string_inside_one_token_is_held_back_then_cut(tok: Tokenizer) -> None:
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


def test_stop_string_spanning_three_tokens_is_found_when_its_last_token_arrives(tok: Tokenizer) -> None:
    # "STOP" = "S" (end of " S") + "TO" + "P": no token, nor two neighbours, holds it.
    pieces = ["Hello", " S", "TO", "P", " after"]
    ids = [one_token(tok, p) for p in pieces]
    assert not any("STOP" in a + b for a, b in itertools.pairwise(pieces))
    seen, d = stream(tok, ids, SamplingParams(stop=["STOP"]))
    assert d.stopped_by == "STOP"
    assert d.token_ids == ids[:4]  # stopped on "P", not later
    assert d.text == "Hello "
    # Views hold back len("STOP") - 1 = 3 characters until the stop is known.
    assert seen == shown_after_each_token(["Hello", "Hello S", "Hello STO"], 3) + ["Hello "]
    _, d = stream(tok, ids, SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    assert d.text == "Hello STOP" and d.token_ids == ids[:4]


def test_stop_string_whose_multibyte_character_is_split_across_tokens(tok: Tokenizer) -> None:
    # "→" (3 UTF-8 bytes) arrives as three byte tokens; the stop "→ r" ends inside " right".
    arrow = "→".encode()
    ids = [one_token(tok, "left"), one_token(tok, " ")] + [byte_token(tok, b) for b in arrow]
    ids += [one_token(tok, " right"), one_token(tok, " after")]
    assert tok.decode(ids) == "left → right after"
    seen, d = stream(tok, ids, SamplingParams(stop=["→ r"]))
    assert d.stopped_by == "→ r" and d.token_ids == ids[:6]
    assert d.text == "left "
    assert all("\ufffd" not in s for s in seen)
    # Holdback counts characters: 2 while "→" or "→ " might start the stop string.
    texts = ["left", "left ", "left ", "left ", "left →"]
    assert seen == shown_after_each_token(texts, 2) + ["left "]
    _, d = stream(tok, ids, SamplingParams(stop=["→ r"], include_stop_str_in_output=True))
    assert d.text == "left → r"


def test_stop_string_at_the_very_start_leaves_no_text(tok: Tokenizer) -> None:
    for ids in (
        [one_token(tok, "STOP"), one_token(tok, " after")],
        [one_token(tok, p) for p in ["ST", "OP", " after"]],
    ):
        seen, d = stream(tok, ids, SamplingParams(stop=["STOP"]))
        assert d.stopped_by == "STOP" and d.text == "" and set(seen) == {""}
        assert len(d.token_ids) == len(ids) - 1
        _, d = stream(tok, ids, SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
        assert d.stopped_by == "STOP" and d.text == "STOP"


def test_text_around_a_stop_string_inside_a_token_is_cut_exactly(tok: Tokenizer) -> None:
    # The stop "her" begins and ends inside " there": the text keeps "Hello   t", spaces and all,
    # and with include_stop_str_in_output ends right after the stop string ("e" is dropped).
    ids = [one_token(tok, p) for p in ["Hello", "  ", " there", " after"]]
    _, d = stream(tok, ids, SamplingParams(stop=["her"]))
    assert (d.stopped_by, d.text) == ("her", "Hello   t")
    _, d = stream(tok, ids, SamplingParams(stop=["her"], include_stop_str_in_output=True))
    assert (d.stopped_by, d.text) == ("her", "Hello   ther")


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    # " there" completes both; "llo t" starts first in the text, though listed second.
    ids = [one_token(tok, p) for p in ["Hello", " there"]]
    _, d = stream(tok, ids, SamplingParams(stop=["ere", "llo t"]))
    assert (d.stopped_by, d.text) == ("llo t", "He")


def test_output_processor_stops_a_request_on_a_stop_string_spanning_one_update(tok: Tokenizer) -> None:
    processor = OutputProcessor(tok)
    params = SamplingParams(stop=["STOP"], max_tokens=20)
    (child,) = processor.add_request("r", "p", [1, 2], params, [])
    ids = [one_token(tok, p) for p in ["Hello", " S", "TO", "P", " after"]]
    # Several tokens in one update (as after a chunk): each is checked, not only the last.
    outputs, stopped = processor.process([EngineCoreOutput(child, ids[:2], None, None, 0)])
    assert stopped == [] and outputs[0].outputs[0].text == "Hell" and not outputs[0].finished
    outputs, stopped = processor.process([EngineCoreOutput(child, ids[2:], None, None, 0)])
    assert stopped == [child]  # the engine core must free it
    out = outputs[0].outputs[0]
    assert outputs[0].finished and (out.finish_reason, out.stop_reason) == ("stop", "STOP")
    assert out.text == "Hello "


def test_stop_strings_are_looked_for_only_past_min_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("hello world hello world")
    assert tok.decode(ids[:1]) == "hello"
    _, plain = stream(tok, ids, SamplingParams(stop="hello"))
    assert plain.stopped_by == "hello" and plain.text == ""
    # As vLLM: the first min_tokens tokens' text is not searched; the second "hello" stops it.
    _, held = stream(tok, ids, SamplingParams(stop="hello", min_tokens=1))
    assert held.stopped_by == "hello" and held.text == "hello world "
