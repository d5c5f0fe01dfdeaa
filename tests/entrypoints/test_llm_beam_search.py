"""LLM.beam_search against an exhaustive search: on a tiny Qwen2-VL cut to a 4-token vocabulary
(eos among them), 9 beams over 3 steps keep every live prefix (at most 3 * 3), so vLLM's search
must return exactly the 9 best of all 40 possible sequences under its score. The oracle enumerates
them with transformers' float32 logits. Over an image prompt (the full tiny checkpoint), the beams
carry the image: the search equals the same rules run on transformers' logits with the pixels, the
image is encoded once, and later steps take the shared prefix from the cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.beam_oracle import EOS, exhaustive
from tests.conftest import random_image
from tests.reference import IMAGE_TOKEN_ID, hf_prompt_ids
from vlmserve.api.beam_search import BeamSearchParams
from vlmserve.entrypoints.llm import LLM

PROMPT = [0]  # one token: the score's length (prompt included) differs most between beams


@pytest.fixture(scope="module")
def small_dir(small_vocab_dir: Path) -> Path:
    return small_vocab_dir  # the session's (tests/conftest.py), shared with the other beam search tests


@pytest.fixture(scope="module")
def small_hf(small_vocab_hf):  # type: ignore[no-untyped-def]
    return small_vocab_hf


@pytest.fixture(scope="module")
def small_llm(small_dir: Path) -> LLM:
    return LLM(small_dir, dtype="float32", max_model_len=64, kv_cache_memory_gib=0.005)


def _assert_same(got, expected, tokens_of=lambda s: s.tokens) -> None:  # type: ignore[no-untyped-def]
    assert [tokens_of(s) for s in got] == [tokens for tokens, _, _ in expected]
    for s, (_, cum, _) in zip(got, expected, strict=True):
        assert s.cum_logprob == pytest.approx(cum, abs=1e-4)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_the_beams_are_the_best_of_every_sequence(small_llm: LLM, small_hf, length_penalty: float) -> None:  # type: ignore[no-untyped-def]
    expected = exhaustive(small_hf, PROMPT, 3, length_penalty)
    # The ranking is not decided by rounding: neighbours differ by more than float32 noise.
    assert min(expected[i][2] - expected[i + 1][2] for i in range(9)) > 1e-4
    (out,) = small_llm.beam_search(
        [{"prompt_token_ids": PROMPT}], BeamSearchParams(9, 3, length_penalty=length_penalty)
    )
    _assert_same(out.sequences, expected[:9])
    tokenizer = small_llm.get_tokenizer()
    for s in out.sequences:  # vLLM's offline shape: tokens and text hold the prompt, an ending eos kept
        assert s.text == tokenizer.decode(s.tokens, False)
        assert s.finish_reason == ("stop" if s.tokens[-1] == EOS else "length")


def test_length_penalty_changes_which_beam_wins(small_llm: LLM, small_hf) -> None:  # type: ignore[no-untyped-def]
    """The same search, only length_penalty differs. The score divides by len ** length_penalty
    (the prompt's token counted): at -4 the one-token length of "eos at once" wins by far, at 4
    a beam of all 3 tokens does; each ranking is the exhaustive one."""
    best = {}
    for lp in (-4.0, 4.0):
        (out,) = small_llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(4, 3, length_penalty=lp))
        expected = exhaustive(small_hf, PROMPT, 3, lp)
        assert out.sequences[0].tokens == expected[0][0]
        best[lp] = out.sequences[0].tokens
    assert best[-4.0] == [*PROMPT, EOS]
    assert len(best[4.0]) == len(PROMPT) + 3 and EOS not in best[4.0]


def test_ignore_eos_keeps_searching_through_eos(small_llm: LLM, small_hf) -> None:  # type: ignore[no-untyped-def]
    expected = exhaustive(small_hf, PROMPT, 2, 1.0, ignore_eos=True)  # 16 sequences, 4 live prefixes
    (out,) = small_llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(9, 2, ignore_eos=True))
    _assert_same(out.sequences, expected[:9])
    assert any(EOS in s.tokens[1:-1] or s.tokens[-1] == EOS for s in out.sequences)


# -- over an image ---------------------------------------------------------------------------------


def _reference_beam_search(
    hf_model, ids: list[int], vision: dict, width: int, steps: int
) -> list[tuple[list[int], float]]:  # type: ignore[no-untyped-def]
    """vLLM's rules on transformers' logits, the pixels given at every step (no eos appears in the
    few tokens of a random-weight model; the test checks it)."""
    beams = [(ids, 0.0)]
    for _ in range(steps):
        candidates = []
        for tokens, cum in beams:
            t = torch.tensor([tokens])
            with torch.no_grad():
                logits = hf_model(
                    input_ids=t,
                    attention_mask=torch.ones_like(t),
                    mm_token_type_ids=(t == IMAGE_TOKEN_ID).int(),
                    **vision,
                ).logits[0, -1]
            top = logits.float().log_softmax(-1).topk(2 * width)
            candidates += [(tokens + [int(i)], cum + float(v)) for v, i in zip(top.values, top.indices, strict=True)]
        beams = sorted(candidates, key=lambda c: c[1], reverse=True)[:width]
    return beams


def test_beams_over_an_image_carry_it_and_reuse_the_caches(
    tiny_dir: Path, hf_model, hf_tokenizer, hf_image_processor
) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(tiny_dir, dtype="float32", max_model_len=1024, kv_cache_memory_gib=0.01)
    image: Image.Image = random_image(120, 90, seed=7)
    text = (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n<|im_start|>assistant\n"
    )
    (out,) = llm.beam_search([{"prompt": text, "multi_modal_data": {"image": image}}], BeamSearchParams(2, 2))
    ids, vision = hf_prompt_ids(hf_tokenizer, hf_image_processor, text, [image])
    expected = _reference_beam_search(hf_model, ids, vision, 2, 2)
    eos = llm.get_tokenizer().eos_token_id
    assert all(eos not in tokens[len(ids) :] for tokens, _ in expected)
    assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in expected]
    for s, (_, cum) in zip(out.sequences, expected, strict=True):
        assert s.cum_logprob == pytest.approx(cum, abs=1e-3)
    scheduler = llm.llm_engine.scheduler
    assert scheduler.encoder_cache.misses == 1  # 1 + 2 requests, one encoding
    # Step 2's 2 requests found the prompt's full blocks cached.
    full_blocks = len(ids) // llm.llm_engine.config.block_size * llm.llm_engine.config.block_size
    assert scheduler.kv.prefix_hits >= 2 * full_blocks > 0


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"beam_width": 11}, "beam_width"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"length_penalty": float("inf")}, "length_penalty"),
    ],
)
def test_bad_parameters_are_named(fields: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name} "):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 2, **fields})  # type: ignore[arg-type]
