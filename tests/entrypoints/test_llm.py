"""The offline API end to end, against transformers' generate on the same checkpoint."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import random_image
from tests.reference import hf_greedy, hf_logits, hf_prompt_ids
from vlmserve import LLM, SamplingParams

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_NEW = 24


def chat_prompt(user: str) -> str:
    system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    return f"{system}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    return LLM(
        tiny_dir,
        dtype="float32",
        max_model_len=4096,
        max_num_seqs=16,
        kv_cache_memory_gib=0.02,
        limit_mm_per_prompt={"image": 3},
    )


@pytest.fixture(scope="module")
def cases(images: dict[str, Image.Image]) -> list[tuple[str, list[Image.Image]]]:
    return [
        (chat_prompt(f"{PAD}What is in this image?"), [images["wide"]]),
        (chat_prompt(f"{PAD}{PAD}Which of the two is darker?"), [images["tall"], images["odd"]]),
        (
            chat_prompt(f"Here is one: {PAD} and another: {PAD} - what changed between them?"),
            [images["small"], images["wide"]],
        ),
        (chat_prompt("Tell me a story about a lighthouse."), []),
    ]


@pytest.fixture(scope="module")
def reference(cases, hf_model, hf_tokenizer, hf_image_processor) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Each prompt run alone through transformers."""
    out = []
    for text, pictures in cases:
        ids, vision = hf_prompt_ids(hf_tokenizer, hf_image_processor, text, pictures)
        out.append(hf_greedy(hf_model, ids, vision, MAX_NEW))
    return out


def free_blocks_are_all_back(llm: LLM) -> bool:
    engine = llm.llm_engine
    return engine.kv.pool.num_free == engine.kv.pool.num_blocks and not engine.has_unfinished_requests()


def test_generate_batch_matches_each_prompt_alone_in_transformers(llm: LLM, cases, reference) -> None:  # type: ignore[no-untyped-def]
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": pictures}} if pictures else text for text, pictures in cases
    ]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert len({tuple(r) for r in reference}) == len(reference)  # the prompts really differ
    for output, (_, pictures) in zip(outputs, cases, strict=True):
        assert output.finished and len(output.num_image_tokens) == len(pictures)
        completion = output.outputs[0]
        assert completion.text == llm.get_tokenizer().decode(completion.token_ids)
        assert completion.finish_reason == ("stop" if completion.token_ids[-1] in (151643, 151645) else "length")
    assert free_blocks_are_all_back(llm)


def test_chat_batch_matches_transformers(llm: LLM, cases, reference, images) -> None:  # type: ignore[no-untyped-def]
    def data_url(image: Image.Image) -> str:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    conversations = [
        [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": images["wide"]},
                    {"type": "text", "text": "What is in this image?"},
                ],
            }
        ],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(images["tall"])}},
                    {"type": "image", "image": images["odd"]},
                    {"type": "text", "text": "Which of the two is darker?"},
                ],
            }
        ],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here is one: "},
                    {"image": images["small"]},
                    {"type": "text", "text": " and another: "},
                    {"image": images["wide"]},
                    {"type": "text", "text": " - what changed between them?"},
                ],
            }
        ],
        [{"role": "user", "content": "Tell me a story about a lighthouse."}],
    ]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outputs] == reference


def test_one_sampling_params_per_prompt(llm: LLM, cases, reference) -> None:  # type: ignore[no-untyped-def]
    text, pictures = cases[0]
    prompt = {"prompt": text, "multi_modal_data": {"image": pictures}}
    outputs = llm.generate(
        [prompt, cases[3][0]],
        [SamplingParams(temperature=0, max_tokens=5), SamplingParams(temperature=0, max_tokens=9)],
    )
    assert outputs[0].outputs[0].token_ids == reference[0][:5]
    assert outputs[1].outputs[0].token_ids == reference[3][:9]
    assert outputs[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="got 3 sampling_params for 2 prompts"):
        llm.generate([cases[3][0]] * 2, [SamplingParams()] * 3)


@pytest.mark.slow
def test_a_seeded_sample_ignores_its_batch_and_sample_i_of_n_is_the_run_with_seed_plus_i(llm: LLM, cases) -> None:  # type: ignore[no-untyped-def]
    text = cases[3][0]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=123)
    a = llm.generate(text, params)[0].outputs[0].token_ids
    # Same seed, another batch around it: same sample.
    b = llm.generate([cases[0][0].replace(PAD, ""), text], params)[1].outputs[0].token_ids
    assert a == b
    c = llm.generate(text, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=124))[0].outputs[0].token_ids
    assert a != c
    # n = 3 samples of a prompt with an image no other test uses (so not in the encoder cache):
    # the image is encoded once, for the first sample, and found in the cache by the other two.
    prompt = {"prompt": chat_prompt(f"{PAD}Say something."), "multi_modal_data": {"image": random_image(84, 56, 31)}}
    cache = llm.llm_engine.scheduler.encoder_cache
    hits, misses = cache.hits, cache.misses
    (out,) = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=7, n=3))
    assert (cache.misses - misses, cache.hits - hits) == (1, 2)
    # Sample i is what a single-sample run with seed 7 + i gives.
    singles = [
        llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=7 + i))[0].outputs[0].token_ids
        for i in range(3)
    ]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert [o.token_ids for o in out.outputs] == singles
    assert len({tuple(tokens) for tokens in singles}) == 3
    assert free_blocks_are_all_back(llm)


def test_stop_conditions(llm: LLM, cases, reference) -> None:  # type: ignore[no-untyped-def]
    text = cases[3][0]
    full = llm.generate(text, SamplingParams(temperature=0, max_tokens=MAX_NEW))[0].outputs[0]
    # stop_token_ids: stop at the 5th generated token, which is kept in token_ids.
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    out = llm.generate(text, SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    # A stop string: cut from the text, the tokens up to the one completing it kept.
    needle = full.text[len(full.text) // 2 :][:3]
    out = llm.generate(text, SamplingParams(temperature=0, max_tokens=MAX_NEW, stop=[needle]))[0].outputs[0]
    assert out.text == full.text[: full.text.index(needle)]
    assert (out.finish_reason, out.stop_reason) == ("stop", needle)
    assert len(out.token_ids) < len(full.token_ids)
    # ignore_eos: a request that would have stopped at eos runs to max_tokens.
    eos = 151645
    out = llm.generate(text, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[], ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
    assert free_blocks_are_all_back(llm)
    assert eos in llm.llm_engine.eos_token_ids


def test_defaults_come_from_generation_config(llm: LLM) -> None:
    params = llm.get_default_sampling_params()
    # generation_config.json of Qwen2-VL-Instruct: temperature 0.01, top_p 0.001, top_k 1.
    assert (params.temperature, params.top_p, params.top_k) == (0.01, 0.001, 1)


def test_bad_input_is_named_and_the_llm_keeps_serving(llm: LLM, cases, reference, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    text, pictures = cases[0]
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"this is not a png")
    bad_prompts = [
        (
            {"prompt": text, "multi_modal_data": {"image": "/missing/cat.png"}},
            r"prompts\[1\].multi_modal_data.image\[0\]: file not found",
        ),
        (
            {"prompt": text, "multi_modal_data": {"image": Image.new("RGB", (2000, 2000))}},
            r"image\[0\]: the image needs 5041 tokens, at most 4095 per image",
        ),
        ({"prompt": text, "multi_modal_data": {"image": str(junk)}}, r"image\[0\]: cannot decode image"),
        ({"prompt": text, "multi_modal_data": {"image": "ftp://host/cat.png"}}, "unsupported URL scheme 'ftp'"),
        ({"prompt": PAD * 4, "multi_modal_data": {"image": pictures * 4}}, "too many images: 4 given, at most 3"),
        (
            {"prompt": text + "more words " * 100, "multi_modal_data": {"image": Image.new("RGB", (1800, 1700))}},
            r"prompt needs 4\d\d\d tokens \(\d+ text \+ 3904 image\).*max_model_len=4096",
        ),
        ({"prompt": text, "multi_modal_data": {"audio": b"x"}}, "unsupported modality"),
    ]
    for bad, message in bad_prompts:
        with pytest.raises(ValueError, match=message):
            llm.generate([cases[3][0], bad], SamplingParams(temperature=0, max_tokens=4))
        assert free_blocks_are_all_back(llm)
    with pytest.raises(ValueError, match=r"conversations\[1\].messages\[0\].content\[0\] \(image 1\): file not found"):
        llm.chat(
            [
                [{"role": "user", "content": "hi"}],
                [{"role": "user", "content": [{"type": "image", "image": "/missing.png"}]}],
            ]
        )
    # ...and the same LLM serves the next call exactly as before.
    out = llm.generate(
        {"prompt": text, "multi_modal_data": {"image": pictures}}, SamplingParams(temperature=0, max_tokens=MAX_NEW)
    )
    assert out[0].outputs[0].token_ids == reference[0]


def test_batch_of_sixteen_and_prefix_cache_hits_change_nothing(llm: LLM, cases, reference) -> None:  # type: ignore[no-untyped-def]
    prompts = [{"prompt": t, "multi_modal_data": {"image": p}} if p else t for t, p in cases]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    outputs = llm.generate(prompts * 4, params)  # 16 requests in one batch
    assert [o.outputs[0].token_ids for o in outputs] == reference * 4
    # Run again: the prompts' full blocks (images included) now come from the prefix cache.
    again = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == reference
    for output in again:
        block = llm.llm_engine.kv.block_size
        assert output.num_cached_tokens == (len(output.prompt_token_ids) - 1) // block * block > 0
    assert free_blocks_are_all_back(llm)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_tight_memory_and_small_budget_change_nothing(tiny_dir: Path, cases, reference, prefix_caching: bool) -> None:  # type: ignore[no-untyped-def]
    """Prompts computed in small chunks (some ending inside an image) and a KV pool so small that
    requests are preempted and recomputed still give transformers' greedy tokens."""
    llm = LLM(
        tiny_dir,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        kv_cache_memory_gib=10 * 16 * 512 / (1 << 30),
    )  # 10 blocks of 16 tokens (512 B/token)
    engine = llm.llm_engine
    assert engine.kv.pool.num_blocks == 10
    preemptions = 0
    original = engine.scheduler._preempt

    def counting(request):  # type: ignore[no-untyped-def]
        nonlocal preemptions
        preemptions += 1
        original(request)

    engine.scheduler._preempt = counting  # type: ignore[method-assign]
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": pictures}} if pictures else text for text, pictures in cases
    ]
    outputs = llm.generate(prompts * 2, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outputs] == reference * 2
    assert preemptions > 0
    assert free_blocks_are_all_back(llm)


def test_logprobs_are_transformers_raw_log_softmax_not_the_sampling_distribution(  # type: ignore[no-untyped-def]
    llm: LLM, cases, hf_model, hf_tokenizer, hf_image_processor
) -> None:
    """vLLM's default (logprobs_mode="raw_logprobs"): each generated token's log-probability, and
    its rank, under the model's own distribution, before temperature and top-k. Sampled here at
    temperature 0.7 with top_k=3 and 5 logprobs asked, so logprobs of the scaled or cut
    distribution (or raw logits) give other values, and ranks 4 and 5 would be -inf."""
    text, pictures = cases[0]
    params = SamplingParams(temperature=0.7, top_k=3, max_tokens=6, seed=5, logprobs=5)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": pictures}}, params)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6

    # transformers on the prompt and the sampled tokens (teacher forcing): position n - 1 + i
    # holds the logits the i-th generated token was drawn from.
    ids, vision = hf_prompt_ids(hf_tokenizer, hf_image_processor, text, pictures)
    logits = hf_logits(hf_model, ids + out.token_ids, vision)[len(ids) - 1 : -1]
    reference = torch.log_softmax(logits.double(), dim=-1)
    tokenizer = llm.get_tokenizer()
    ranks = []
    for token_id, entry, ref in zip(out.token_ids, out.logprobs, reference, strict=True):
        top5 = ref.topk(5).indices.tolist()
        assert set(entry) == set(top5)  # the sampled token is among them: top_k=3 leaves only ranks 1-3
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(float(ref[tid]), abs=1e-4)
            # Rank under the raw distribution (1 + the tokens more likely); ties closer than 1e-5
            # may go either way.
            assert 1 + int((ref > ref[tid] + 1e-5).sum()) <= lp.rank <= int((ref >= ref[tid] - 1e-5).sum())
            assert lp.decoded_token == tokenizer.decode([tid], skip_special_tokens=False)
        ranks.append(entry[token_id].rank)
    assert max(ranks) > 1  # some draws were not the most likely token: the rank is really checked
    assert max(ranks) <= 3  # top_k=3 did cut the sampling
    expected_total = float(reference[torch.arange(6), torch.tensor(out.token_ids)].sum())
    assert out.cumulative_logprob == pytest.approx(expected_total, abs=1e-3)
    # Asking for logprobs does not change what is sampled.
    plain = llm.generate(
        {"prompt": text, "multi_modal_data": {"image": pictures}},
        SamplingParams(temperature=0.7, top_k=3, max_tokens=6, seed=5),
    )[0].outputs[0]
    assert plain.logprobs is None and plain.token_ids == out.token_ids


def test_empty_and_out_of_range_prompts_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate("", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"token ids must be in 0..151935; position 1 holds 1000000"):
        llm.generate({"prompt_token_ids": [5, 10**6]}, SamplingParams(max_tokens=2))
    assert free_blocks_are_all_back(llm)
    assert len(llm.generate("still here", SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_truncate_prompt_tokens_and_continue_final_message_offline(llm: LLM) -> None:
    """vLLM's SamplingParams.truncate_prompt_tokens keeps the prompt's last N tokens (-1:
    max_model_len); LLM.chat's continue_final_message leaves the last message open."""
    text = "one two three four five six seven eight nine ten"
    ids = llm.get_tokenizer().encode(text)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    cut = llm.generate(text, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, truncate_prompt_tokens=4))
    by_hand = llm.generate({"prompt_token_ids": ids[-4:]}, greedy)
    assert cut[0].prompt_token_ids == ids[-4:]
    assert cut[0].outputs[0].token_ids == by_hand[0].outputs[0].token_ids
    whole = llm.generate(text, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))
    assert whole[0].prompt_token_ids == ids
    with pytest.raises(ValueError, match="greater than max_model_len"):
        llm.generate(text, SamplingParams(max_tokens=1, truncate_prompt_tokens=4097))
    with pytest.raises(ValueError, match=">= 1 or -1"):
        SamplingParams(truncate_prompt_tokens=0)
    messages = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello, I am"}]
    (open_turn,) = llm.chat(messages, greedy, add_generation_prompt=False, continue_final_message=True)
    assert open_turn.prompt_token_ids[-len(llm.get_tokenizer().encode(" am")) :] == llm.get_tokenizer().encode(" am")
    assert llm.get_tokenizer().decode(open_turn.prompt_token_ids, skip_special_tokens=False).endswith("Hello, I am")


def test_chat_renders_the_template_it_is_given_and_names_the_line_where_one_fails(llm: LLM, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """vLLM's LLM.chat(chat_template=...): the prompt is that template's, as transformers renders
    it; one that does not parse or fails to render is a ValueError naming its line."""
    template = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}<<assistant>>"
    messages = [{"role": "user", "content": "Say hi."}]
    [output] = llm.chat(messages, SamplingParams(max_tokens=1), chat_template=template)
    text = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert list(output.prompt_token_ids) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="does not parse: line 2"):
        llm.chat(messages, chat_template="ok\n{% for m in messages %}")
    with pytest.raises(ValueError, match=r"no tools here \(template line 2\)"):
        llm.chat(messages, chat_template="{{ messages[0].content }}\n{{ raise_exception('no tools here') }}")
