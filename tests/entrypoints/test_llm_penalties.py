"""Penalties against transformers' generate, greedy, several prompts batched in vlmserve and each
run alone in transformers: repetition_penalty from the checkpoint's generation_config.json (as
Qwen2-VL-Instruct's 1.05), and presence/frequency penalties set through SamplingParams (checked
against a plain reference processor written here, OpenAI's formula)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.reference import IMAGE_TOKEN_ID, hf_prompt_ids
from vlmserve import LLM, SamplingParams

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_NEW = 24
PENALTY = 1.05


def chat_prompt(user: str) -> str:
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    return f"{system}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def penalized_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with Qwen2-VL-Instruct's repetition_penalty in generation_config.json."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny-penalized"
    shutil.copytree(tiny_dir, out)
    config = json.loads((out / "generation_config.json").read_text())
    config["repetition_penalty"] = PENALTY
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def llm(penalized_dir: Path) -> LLM:
    return LLM(penalized_dir, dtype="float32", max_model_len=2048, max_num_seqs=8, kv_cache_memory_gib=0.02)


@pytest.fixture(scope="module")
def hf_penalized(penalized_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(penalized_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cases(llm: LLM, images: dict[str, Image.Image], hf_tokenizer, hf_image_processor) -> list[tuple]:  # type: ignore[no-untyped-def]
    """(vlmserve's prompt, transformers' token ids and vision inputs) per prompt. The last prompt
    ends with the model's own unpenalized greedy continuation of another: the tokens it would
    repeat are in the prompt, so a penalty that skipped prompt tokens would pick differently."""
    prompts = [
        (chat_prompt(f"{PAD}What is in this image?"), [images["wide"]]),
        (chat_prompt("Tell me a story about a lighthouse."), []),
        (chat_prompt(f"{PAD}{PAD}Which of the two is darker?"), [images["tall"], images["odd"]]),
        (chat_prompt("Count: one two three four five six seven"), []),
    ]
    out = [
        (
            {"prompt": text, "multi_modal_data": {"image": pictures}} if pictures else text,
            *hf_prompt_ids(hf_tokenizer, hf_image_processor, text, pictures),
        )
        for text, pictures in prompts
    ]
    ids = out[1][1]
    free = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    echoed = ids + free[0].outputs[0].token_ids
    return [*out, ({"prompt_token_ids": echoed}, echoed, {})]


class OpenAIPenalties:
    """Reference presence/frequency penalties, one row and one token at a time: logit -=
    frequency * (times the token is in the output) + presence * (it is in the output at all)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row in range(scores.shape[0]):
            counts: dict[int, int] = {}
            for token in input_ids[row, self.prompt_len :].tolist():
                counts[token] = counts.get(token, 0) + 1
            for token, count in counts.items():
                scores[row, token] -= self.frequency * count + self.presence
        return scores


def hf_generate(hf_model, prompt_ids: list[int], vision: dict, **kwargs) -> list[int]:  # type: ignore[no-untyped-def]
    """transformers' generate, greedy; the model's generation_config.json supplies repetition_penalty
    unless kwargs override it."""
    from transformers import LogitsProcessorList

    ids = torch.tensor([prompt_ids])
    extra = kwargs.pop("penalties", None)
    max_new = kwargs.pop("max_new", MAX_NEW)
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=(ids == IMAGE_TOKEN_ID).int(),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            logits_processor=LogitsProcessorList([extra(len(prompt_ids))] if extra else []),
            **vision,
            **kwargs,
        )
    return out[0, ids.shape[1] :].tolist()


def vlm_generate(llm: LLM, cases, params: SamplingParams) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """All prompts in one batch."""
    return [o.outputs[0].token_ids for o in llm.generate([prompt for prompt, _, _ in cases], params)]


@pytest.mark.slow
def test_the_checkpoints_repetition_penalty_is_the_default_and_matches_transformers(
    llm: LLM, hf_penalized, cases
) -> None:  # type: ignore[no-untyped-def]
    defaults = llm.get_default_sampling_params()
    assert defaults.repetition_penalty == PENALTY
    # Qwen2-VL-Instruct's defaults are top_k 1 (greedy in effect); eos ignored to compare MAX_NEW tokens.
    params = dataclasses.replace(defaults, max_tokens=MAX_NEW, ignore_eos=True)
    expected = [hf_generate(hf_penalized, ids, vision) for _, ids, vision in cases]
    assert vlm_generate(llm, cases, params) == expected
    # The penalty changes what greedy decoding picks here, in more than one prompt.
    without = vlm_generate(llm, cases, dataclasses.replace(params, repetition_penalty=1.0))
    assert sum(a != b for a, b in zip(expected, without, strict=True)) >= 2


def test_a_strong_penalty_set_per_request_counts_the_prompt(llm: LLM, hf_penalized, cases) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=2.0)
    expected = [hf_generate(hf_penalized, ids, vision, repetition_penalty=2.0, max_new=6) for _, ids, vision in cases]
    assert vlm_generate(llm, cases, params) == expected
    # The first token is picked with an empty output: where it differs from the unpenalized
    # one, only the prompt's tokens can have made it.
    plain = vlm_generate(llm, cases, dataclasses.replace(params, repetition_penalty=1.0))
    assert any(a[0] != b[0] for a, b in zip(expected, plain, strict=True))


def test_presence_and_frequency_penalties_match_a_reference_processor(llm: LLM, hf_penalized, cases) -> None:  # type: ignore[no-untyped-def]
    presence, frequency = 0.6, 0.4
    params = SamplingParams(
        temperature=0,
        max_tokens=MAX_NEW,
        ignore_eos=True,
        repetition_penalty=PENALTY,
        presence_penalty=presence,
        frequency_penalty=frequency,
    )
    # transformers applies the checkpoint's repetition penalty first, then the reference: vLLM's order.
    expected = [
        hf_generate(hf_penalized, ids, vision, penalties=lambda n: OpenAIPenalties(n, presence, frequency))
        for _, ids, vision in cases
    ]
    assert vlm_generate(llm, cases, params) == expected
    without = vlm_generate(llm, cases, dataclasses.replace(params, presence_penalty=0.0, frequency_penalty=0.0))
    assert sum(a != b for a, b in zip(expected, without, strict=True)) >= 2
    # Each alone matters too (a sign error or a swapped pair would show).
    only_presence = vlm_generate(llm, cases, dataclasses.replace(params, frequency_penalty=0.0))
    assert only_presence != expected


def test_min_tokens_holds_back_a_stop_token_and_logit_bias_and_bad_words_steer(llm: LLM, cases) -> None:  # type: ignore[no-untyped-def]
    prompt = cases[1][0]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    free = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    stop = free[2]
    assert free[:2].count(stop) == 0
    # The stop token ends the output at once, unless min_tokens holds it back (masked, not just ignored).
    stopped = llm.generate(prompt, dataclasses.replace(greedy, stop_token_ids=[stop]))[0].outputs[0]
    assert stopped.token_ids == free[:3] and stopped.finish_reason == "stop"
    held = llm.generate(prompt, dataclasses.replace(greedy, stop_token_ids=[stop], min_tokens=5))[0].outputs[0]
    assert stop not in held.token_ids[:5] and len(held.token_ids) >= 5
    assert held.token_ids[:2] == free[:2] and held.token_ids[2] != stop
    # logit_bias: +100 on one token makes greedy decoding pick it every time.
    biased = llm.generate(prompt, dataclasses.replace(greedy, logit_bias={1234: 100.0}))[0].outputs[0]
    assert biased.token_ids == [1234] * 8
    # bad_words: the first greedy token's word, banned, is not the first token any more.
    word = llm.get_tokenizer().decode([free[0]])
    assert word.strip()
    banned = llm.generate(prompt, dataclasses.replace(greedy, bad_words=[word]))[0].outputs[0]
    assert banned.token_ids[0] != free[0]


def test_a_logit_bias_past_the_vocabulary_is_refused_by_name(llm: LLM, cases) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="^logit_bias has token ids past the vocabulary"):
        llm.generate(cases[1][0], SamplingParams(logit_bias={10**9: 1.0}))
    assert llm.generate(cases[1][0], SamplingParams(temperature=0, max_tokens=2))[0].finished


def test_generation_config_modes() -> None:
    from vlmserve.api.frontend import sampling_defaults

    qwen2_vl_instruct = {
        "do_sample": True,
        "repetition_penalty": 1.05,
        "temperature": 0.1,
        "top_k": 1,
        "top_p": 0.001,
        "eos_token_id": [151645, 151643],
    }
    assert sampling_defaults("auto", qwen2_vl_instruct) == {
        "repetition_penalty": 1.05,
        "temperature": 0.1,
        "top_k": 1,
        "top_p": 0.001,
    }
    assert sampling_defaults("vllm", qwen2_vl_instruct) == {}
    # Qwen-VL-Chat's max_new_tokens is vLLM's max_tokens.
    assert sampling_defaults("auto", {"top_p": 0.3, "max_new_tokens": 512}) == {"top_p": 0.3, "max_tokens": 512}
