"""Qwen3.5 (Gated DeltaNet + gated full attention, a per-request state cache) against
transformers 5.23 on the same tiny checkpoint files: config parsing, the delta rule and causal
conv against transformers' torch fallbacks (state carried across chunks), and through the
engine: a batch of 16 of mixed lengths, preemption and resume, prefix caching (reuse only up to a
block whose state is cached), memory planning that counts the state slots. Float32 logits through
a chunked prefill plus decode steps, and greedy tokens batched, alone and cached, are the
families' conformance suite's (tests/families)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.conftest import random_image
from tests.engine.test_preemption_multimodal import (
    assert_same_tokens_and_logprobs,
    hf_greedy_with_logprobs,
    run,
    start_trace,
)
from tests.model_harness import Harness
from tests.reference import hf_mm_prompt_ids
from vlmserve.bench.shared_preamble import shop_system_prompt, shop_tools
from vlmserve.engine.config import EngineConfig
from vlmserve.entrypoints.llm_engine import LLMEngine
from vlmserve.families.qwen3_5 import deltanet
from vlmserve.families.qwen3_5.config import Qwen35FamilyConfig
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.processor.base import ImageInput
from vlmserve.registry import load_model_config, parse_model_config

__all__ = ["start_trace"]  # the fixture, used by name

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
BLOCK_SIZE = 16
# The tiny model in float32: 2 full-attention layers x (K + V) x 2 heads x 64 x 4 bytes.
KV_BYTES_PER_TOKEN = 2048
# 2 linear-attention layers x (conv window 128 x 3 + recurrent state 4 x 16 x 16 float32) x 4 bytes.
STATE_BYTES_PER_SLOT = 2 * (128 * 3 + 4 * 16 * 16) * 4


def chat(*parts: str) -> str:
    return f"<|im_start|>user\n{''.join(parts)}<|im_end|>\n<|im_start|>assistant\n"


def image(grid_h: int, grid_w: int, seed: int) -> Image.Image:
    return random_image(16 * grid_w, 16 * grid_h, seed=seed)


@pytest.fixture(scope="module")
def harness(tiny35_dir: Path) -> Harness:
    return Harness(tiny35_dir, torch.float32)


def make_engine(model_dir: Path, **overrides) -> LLMEngine:  # type: ignore[no-untyped-def]
    fields = dict(
        model=str(model_dir),
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=64,
        block_size=BLOCK_SIZE,
        kv_cache_memory_bytes=64 * BLOCK_SIZE * KV_BYTES_PER_TOKEN,
        limit_mm_per_prompt={"image": 2, "video": 1},
    )
    return LLMEngine(EngineConfig(**(fields | overrides)))


def hf_inputs(model_dir: Path, text: str, pictures: list[Image.Image]) -> tuple[list[int], dict]:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return hf_mm_prompt_ids(tokenizer, Qwen2VLImageProcessorPil.from_pretrained(str(model_dir)), text, pictures)


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parity
def test_tiny_config_reads_as_transformers_reads_it(tiny35_dir: Path) -> None:
    from transformers import AutoConfig

    ours, theirs = load_model_config(tiny35_dir / "config.json"), AutoConfig.from_pretrained(str(tiny35_dir))
    text = theirs.text_config
    family = ours.family_config
    assert isinstance(family, Qwen35FamilyConfig)
    assert list(family.layer_types) == text.layer_types == ["linear_attention", "full_attention"] * 2
    assert (family.num_k_heads, family.num_v_heads) == (text.linear_num_key_heads, text.linear_num_value_heads)
    assert (family.key_head_dim, family.value_head_dim) == (text.linear_key_head_dim, text.linear_value_head_dim)
    assert family.conv_kernel_dim == text.linear_conv_kernel_dim
    assert family.rotary_dim == int(text.head_dim * text.rope_parameters["partial_rotary_factor"]) == 16
    assert ours.text.mrope_section == tuple(text.rope_parameters["mrope_section"])


@pytest.mark.parity
def test_transformers_default_config_parses() -> None:
    """transformers' Qwen3_5Config() (the 9B-style defaults): full attention every 4th layer,
    64 of 256 head dimensions rotated, mrope_section (11, 11, 10) over them. (Its default vision
    width, 3584, is not its default hidden size: set to match.)"""
    from transformers import Qwen3_5Config

    config = parse_model_config(Qwen3_5Config(vision_config={"out_hidden_size": 4096}).to_dict())
    family = config.family_config
    assert family.layer_types == tuple(
        "full_attention" if i % 4 == 3 else "linear_attention" for i in range(config.text.num_hidden_layers)
    )
    assert (config.text.head_dim, family.rotary_dim, config.text.mrope_section) == (256, 64, (11, 11, 10))
    assert (family.num_k_heads, family.num_v_heads, family.key_head_dim, family.conv_kernel_dim) == (16, 32, 128, 4)
    assert config.image_token_id == 248056


def test_bad_configs_say_what_is_wrong(tiny35_dir: Path) -> None:
    import json

    raw = json.loads((tiny35_dir / "config.json").read_text())
    bad_section = json.loads(json.dumps(raw))
    bad_section["text_config"]["rope_parameters"]["mrope_section"] = [4, 4, 4]
    with pytest.raises(ValueError, match=r"mrope_section \[4, 4, 4\] must be three numbers summing to .* 8"):
        parse_model_config(bad_section)
    bad_types = json.loads(json.dumps(raw))
    bad_types["text_config"]["layer_types"] = ["linear_attention", "sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types must name 4 layers.*got 3 with \['sliding_attention'\]"):
        parse_model_config(bad_types)


# -- the delta rule and the conv against transformers' torch fallbacks ---------------------------


@pytest.mark.parity
def test_chunked_delta_rule_carries_its_state_across_chunks() -> None:
    """A 150-token sequence from a random state in chunks of 37, 64 and 49 tokens (chunk
    boundaries off the 64-token grid) against transformers' chunked rule over the whole."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    n, hk, hv, dk, dv = 150, 2, 4, 16, 8
    q, k = torch.randn(1, n, hk, dk, generator=g), torch.randn(1, n, hk, dk, generator=g)
    v = torch.randn(1, n, hv, dv, generator=g)
    decay, beta = -0.2 * torch.rand(1, n, hv, generator=g), torch.rand(1, n, hv, generator=g)
    state = torch.randn(1, hv, dk, dv, generator=g)
    ref, ref_state = torch_chunk_gated_delta_rule(
        q, k, v, g=decay, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    outs, s, start = [], state[0], 0
    for size in (37, 64, 49):
        sl = slice(start, start + size)
        out, s = deltanet.chunk_gated_delta_rule(q[0, sl], k[0, sl], v[0, sl], decay[0, sl], beta[0, sl], s)
        outs.append(out)
        start += size
    assert (torch.cat(outs) - ref[0]).abs().max().item() < 1e-5
    assert (s - ref_state[0]).abs().max().item() < 1e-5


@pytest.mark.parity
def test_recurrent_step_matches_transformers_for_a_batch() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(1)
    b, hk, hv, dk, dv = 3, 2, 4, 16, 8
    q, k = torch.randn(b, 1, hk, dk, generator=g), torch.randn(b, 1, hk, dk, generator=g)
    v = torch.randn(b, 1, hv, dv, generator=g)
    decay, beta = -torch.rand(b, 1, hv, generator=g), torch.rand(b, 1, hv, generator=g)
    state = torch.randn(b, hv, dk, dv, generator=g)
    ref, ref_state = torch_recurrent_gated_delta_rule(
        q, k, v, g=decay, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    out, s = deltanet.recurrent_gated_delta_step(q[:, 0], k[:, 0], v[:, 0], decay[:, 0], beta[:, 0], state)
    assert (out - ref[:, 0]).abs().max().item() < 1e-6 and (s - ref_state).abs().max().item() < 1e-6


@pytest.mark.parity
def test_causal_conv_carries_its_window_across_chunks_and_steps() -> None:
    """transformers' causal conv over 20 tokens = ours over 7 + 11 tokens, then two single steps."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    g = torch.Generator().manual_seed(2)
    channels, kernel = 12, 4
    x, weight = torch.randn(20, channels, generator=g), torch.randn(channels, kernel, generator=g)
    ref = causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    window = torch.zeros(channels, kernel - 1)
    first, window = deltanet.causal_conv1d(x[:7], window, weight)
    second, window = deltanet.causal_conv1d(x[7:18], window, weight)
    steps = []
    for t in (18, 19):
        out, windows = deltanet.causal_conv1d_step(x[t][None], window[None], weight)
        steps.append(out)
        window = windows[0]
    assert (torch.cat([first, second, *steps]) - ref).abs().max().item() < 1e-6


def test_recurrent_rows_give_what_single_token_steps_give_one_by_one() -> None:
    """Three sequences of 3, 1 and 5 new tokens (a verify step's rows beside a decode) from their
    slots' windows and states, token j of each batched: every output row, window and state is what
    the single-token steps (conv step, then delta step) give, run token by token, bit for bit."""
    g = torch.Generator().manual_seed(3)
    hk, hv, dk, dv, kernel = 2, 4, 16, 8, 4
    channels = 2 * hk * dk + hv * dv
    lengths, slots = [3, 1, 5], [2, 0, 3]
    n = sum(lengths)
    mixed = torch.randn(n, channels, generator=g).bfloat16()
    decay, beta = -torch.rand(n, hv, generator=g), torch.rand(n, hv, generator=g)
    weight = torch.randn(channels, kernel, generator=g).bfloat16()
    windows = torch.randn(4, channels, kernel - 1, generator=g).bfloat16()
    states = torch.randn(4, hv, dk, dv, generator=g)

    def heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = x.split([hk * dk, hk * dk, hv * dv], dim=-1)
        return q.reshape(-1, hk, dk), k.reshape(-1, hk, dk), v.reshape(-1, hv, dv)

    spans = [(0, 3), (3, 4), (4, 9)]
    expected_windows, expected_states = windows.clone(), states.clone()
    expected = torch.empty(n, hv, dv)
    after: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # sequence -> (window, state) after each token
    for i, ((start, end), slot) in enumerate(zip(spans, slots, strict=True)):
        for t in range(start, end):
            conv, window = deltanet.causal_conv1d_step(mixed[t][None], expected_windows[slot][None], weight)
            q, k, v = heads(conv)
            out, state = deltanet.recurrent_gated_delta_step(
                q, k, v, decay[t][None], beta[t][None], expected_states[slot][None]
            )
            expected[t], expected_windows[slot], expected_states[slot] = out[0], window[0], state[0]
            after.setdefault(i, []).append((expected_windows[slot].clone(), expected_states[slot].clone()))
    out = torch.empty(n, hv, dv)
    # The states after each token, kept for the first and third sequences (rollback of drafts).
    kept = deltanet.recurrent_rows(
        mixed, decay, beta, weight, heads, windows, states, spans, slots, out, [True, False, True]
    )
    assert torch.equal(out, expected)
    assert sorted(kept) == [0, 2]
    for i, (kept_windows, kept_states) in kept.items():
        assert kept_windows.shape[0] == kept_states.shape[0] == lengths[i]
        for j, (window, state) in enumerate(after[i]):
            assert torch.equal(kept_windows[j], window) and torch.equal(kept_states[j], state), (i, j)
    # (slot 1, no sequence's, is left as it was: the expected pools' copy of it is untouched too)
    assert torch.equal(windows, expected_windows) and torch.equal(states, expected_states)


# -- greedy through the engine (batched and alone: the families' conformance suite) --------------


def test_a_batch_of_16_mixed_lengths_gives_each_its_tokens_alone(tiny35_dir: Path) -> None:
    """16 text prompts of 5 to 200 tokens in one run (a 96-token budget: long ones prefill in
    chunks beside decoding ones, several chunks in one step) give the tokens each gets alone."""
    engine = make_engine(tiny35_dir, max_num_batched_tokens=96, kv_cache_memory_bytes=160 * BLOCK_SIZE * 2048)
    g = torch.Generator().manual_seed(3)
    prompts = {}
    for i in range(16):
        length = 5 + (i * 13) % 196
        ids = torch.randint(200, 150000, (length,), generator=g).tolist()
        prompts[f"r{i:02d}"] = ProcessedPrompt(prompt_token_ids=ids, mm_items=[], mrope_positions=None, mrope_delta=0)
    batched = run(engine, prompts, max_tokens=6)
    for key, prompt in prompts.items():
        alone = run(engine, {key: prompt}, max_tokens=6)
        assert batched[key].outputs[0].token_ids == alone[key].outputs[0].token_ids, key


@pytest.mark.parity
def test_a_preempted_request_rebuilds_its_state_and_gives_transformers_tokens(  # type: ignore[no-untyped-def]
    tiny35_dir: Path, hf35_model, start_trace
) -> None:
    """6 blocks (96 tokens) for two ~80-token image prompts with 12 new tokens each: the newer
    is preempted (its state slot freed), recomputed from its first token, and still gives
    transformers' tokens and logprobs."""
    engine = make_engine(tiny35_dir, max_num_batched_tokens=24, kv_cache_memory_bytes=8 * BLOCK_SIZE * 2048)
    texts = {"old": chat(IMAGE, "What is this?"), "new": chat(IMAGE, "Describe the scene.")}
    pictures = {"old": image(16, 16, 22), "new": image(14, 20, 21)}
    prompts = {k: engine.processor.process(texts[k], [ImageInput(pictures[k])]) for k in texts}
    trace = start_trace(engine)
    outputs = run(engine, prompts, max_tokens=12)
    assert trace.preempted and {request_id for request_id, _ in trace.preempted} == {"new"}
    assert all(computed > 0 for _, computed in trace.preempted), "preempted with state computed"
    for key in texts:
        ids, vision = hf_inputs(tiny35_dir, texts[key], [pictures[key]])
        assert ids == outputs[key].prompt_token_ids
        assert_same_tokens_and_logprobs(outputs[key], hf_greedy_with_logprobs(hf35_model, ids, vision, 12))
    assert engine.kv.groups[0].slots.num_free == engine.kv.groups[0].slots.num_slots


@pytest.mark.parity
def test_a_repeated_image_prompt_reuses_kv_and_state_and_gives_transformers_tokens(  # type: ignore[no-untyped-def]
    tiny35_dir: Path, hf35_model
) -> None:
    """The first run saves the state where the prompt's last reusable block ends; a repeat
    reuses the KV up to there with that state (num_cached_tokens > 0) and gives transformers'
    tokens and logprobs again, as does the conversation's next turn (a prompt that starts with
    the first one)."""
    engine = make_engine(tiny35_dir)
    assert engine.kv.enable_prefix_caching
    text, picture = chat(IMAGE, "Describe it."), image(14, 20, 5)
    prompt = engine.processor.process(text, [ImageInput(picture)])
    ids, vision = hf_inputs(tiny35_dir, text, [picture])
    expected = hf_greedy_with_logprobs(hf35_model, ids, vision, 6)
    save_at = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    cached = []
    for attempt in range(3):
        out = run(engine, {f"a{attempt}": prompt}, max_tokens=6)[f"a{attempt}"]
        cached.append(out.num_cached_tokens)
        assert_same_tokens_and_logprobs(out, expected)
    assert cached == [0, save_at, save_at] and save_at >= 4 * BLOCK_SIZE
    hit_rate = engine.kv.prefix_hits / engine.kv.prefix_queries
    assert hit_rate == 2 * save_at / (3 * len(ids))
    # The next turn of the same conversation: the first prompt is its start.
    longer = text + "Noise.<|im_end|>\n" + chat("What colour dominates?")
    prompt2 = engine.processor.process(longer, [ImageInput(picture)])
    ids2, _ = hf_inputs(tiny35_dir, longer, [picture])
    assert ids2[:save_at] == ids[:save_at]
    out = run(engine, {"longer": prompt2}, max_tokens=6)["longer"]
    assert out.num_cached_tokens == save_at
    assert_same_tokens_and_logprobs(out, hf_greedy_with_logprobs(hf35_model, ids2, vision, 6))


@pytest.mark.parity
def test_cached_kv_without_the_state_at_its_end_is_not_reused(tiny35_dir: Path, hf35_model) -> None:  # type: ignore[no-untyped-def]
    """A prompt sharing the first blocks of a cached one but diverging before its save point:
    those blocks' KV is cached, the state at their end is not, so nothing is reused and the
    tokens are transformers'."""
    engine = make_engine(tiny35_dir)
    picture = image(14, 20, 6)
    first = chat(IMAGE, "Describe it in one long sentence, please.")
    run(engine, {"first": engine.processor.process(first, [ImageInput(picture)])}, max_tokens=2)
    second = chat(IMAGE, "Count the objects.")
    prompt = engine.processor.process(second, [ImageInput(picture)])
    ids, vision = hf_inputs(tiny35_dir, second, [picture])
    first_ids, _ = hf_inputs(tiny35_dir, first, [picture])
    shared = next(i for i, (x, y) in enumerate(zip(ids, first_ids, strict=False)) if x != y)
    first_save = (len(first_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert BLOCK_SIZE <= shared < first_save, "full blocks of KV are cached, but no state at their end"
    assert engine.kv.kv.block_hashes(_request(prompt), 1)[0] in engine.kv.pool.cached  # its KV is there
    out = run(engine, {"second": prompt}, max_tokens=6)["second"]
    assert out.num_cached_tokens == 0
    assert_same_tokens_and_logprobs(out, hf_greedy_with_logprobs(hf35_model, ids, vision, 6))


# A shop assistant's system prompt (~750 tokens) and four tools (~350 more, rendered into the
# system message by the chat template): the preamble an agent's requests share (the benchmark's).
SHOP_SYSTEM = shop_system_prompt()
SHOP_TOOLS = shop_tools()


def test_requests_sharing_a_system_prompt_and_tools_reuse_its_state_whatever_follows(tiny35_dir: Path) -> None:
    """8 chats with the same system prompt and tool list, each its own question: the state is
    saved where the system message ends, so from the second on the shared part comes from the
    cache (all but its last partial block), and the greedy tokens are those of a run without
    prefix caching. (Saved at the prompt's last full block only, nothing was shared: that
    block holds the question.)"""
    from vlmserve import LLM, SamplingParams

    chats = [
        [
            {"role": "system", "content": SHOP_SYSTEM},
            {"role": "user", "content": f"Where is item {i}, what is its price?"},
        ]
        for i in range(8)
    ]
    greedy = SamplingParams(max_tokens=4, temperature=0)
    outputs = {}
    for caching in (True, False):
        llm = LLM(
            tiny35_dir,
            dtype="float32",
            max_model_len=2048,
            kv_cache_memory_gib=0.02,
            enable_prefix_caching=caching,
        )
        outputs[caching] = [llm.chat(c, greedy, chat_template_kwargs={"tools": SHOP_TOOLS})[0] for c in chats]
    first, second = outputs[True][0].prompt_token_ids, outputs[True][1].prompt_token_ids
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= 1000 and 151645 in first[:shared]  # the system message (ending <|im_end|>) is shared
    cached = [out.num_cached_tokens for out in outputs[True]]
    assert cached[0] == 0
    assert all(shared - BLOCK_SIZE < n <= shared and n >= 0.9 * shared for n in cached[1:]), (shared, cached)
    assert [o.outputs[0].token_ids for o in outputs[True]] == [o.outputs[0].token_ids for o in outputs[False]]
    assert all(out.num_cached_tokens == 0 for out in outputs[False])


def _request(prompt: ProcessedPrompt):  # type: ignore[no-untyped-def]
    from vlmserve.engine.request import Request
    from vlmserve.sampling_params import SamplingParams

    return Request("probe", prompt, SamplingParams(max_tokens=1), frozenset(), 1 << 20)


# -- memory planning ------------------------------------------------------------------------------


def test_the_memory_plan_counts_state_slots_and_refuses_with_numbers(tiny35_dir: Path) -> None:
    engine = make_engine(tiny35_dir, max_num_seqs=8)
    assert engine.core.runner.state_bytes_per_slot == STATE_BYTES_PER_SLOT
    plan = engine.core.memory_plan
    # 8 running requests' slots, and as many for states saved for prefix caching.
    assert plan.state_cache_bytes == 16 * STATE_BYTES_PER_SLOT and "per-request state" in plan.describe()
    for layer in engine.core.runner.state_layers:
        assert [tuple(s.shape) for s in layer.states] == [(16, 128, 3), (16, 4, 16, 16)]
    without = make_engine(tiny35_dir, max_num_seqs=8, enable_prefix_caching=False)
    assert without.core.memory_plan.state_cache_bytes == 8 * STATE_BYTES_PER_SLOT


def test_a_budget_without_room_for_the_state_slots_is_refused_with_numbers() -> None:
    """What the budget leaves after weights, activations and encoder cache holds the KV of one
    sequence but not that plus the state slots: refused, naming the state and max_num_seqs."""
    from vlmserve.engine.memory import GiB, plan_kv_cache

    common = dict(
        weights_bytes=GiB,
        activation_bytes=GiB // 2,
        encoder_cache_bytes=GiB // 4,
        block_bytes=BLOCK_SIZE * KV_BYTES_PER_TOKEN,
        block_size=BLOCK_SIZE,
        min_blocks=32,
        max_useful_blocks=1024,
    )
    budget = 2 * GiB
    plan = plan_kv_cache(budget_bytes=budget, **common)  # type: ignore[arg-type]
    assert plan.num_blocks == 1024
    with pytest.raises(
        ValueError,
        match=r"budget of 2\.00 GiB is too small: weights 1\.00 GiB .* \+ per-request state 0\.25 GiB "
        r"\(max_num_seqs slots\) leave 0\.00 GiB .* needs at least 32 blocks .*max_num_seqs",
    ):
        plan_kv_cache(budget_bytes=budget, state_cache_bytes=GiB // 4, **common)  # type: ignore[arg-type]


# -- inspect --------------------------------------------------------------------------------------


@pytest.mark.parity
def test_inspect_reports_state_bytes_per_request_beside_kv_bytes_per_token() -> None:
    """transformers' default Qwen3.5 (32 layers: 24 Gated DeltaNet, 8 full attention) in bfloat16:
    KV 8 x (K + V) x 4 heads x 256 x 2 bytes per token; per request, each DeltaNet layer's conv
    window (2 x 16 x 128 + 32 x 128 = 8192 channels x 3 taps x 2 bytes) and float32 recurrent
    state (32 heads x 128 x 128 x 4 bytes)."""
    from transformers import Qwen3_5Config

    from vlmserve.inspect import format_report, inspect_config

    config = parse_model_config(Qwen3_5Config(vision_config={"out_hidden_size": 4096}).to_dict())
    report = inspect_config(config, torch.bfloat16)
    assert report.kv_bytes_per_token == 8 * 2 * 4 * 256 * 2
    assert report.state_bytes_per_request == 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    text = format_report(report)
    assert "state per request: 51,511,296 bytes (49.12 MiB)" in text
    assert "24 layers x (8192 x 3 bfloat16 + 32 x 128 x 128 float32)" in text


def test_make_tiny_writes_the_published_layout(tmp_path: Path) -> None:
    import json

    from vlmserve.entrypoints.cli import main

    out = tmp_path / "q35"
    assert main(["make-tiny", "--arch", "qwen3_5", "--untied", "--shards", "2", str(out)]) == 0
    config = load_model_config(out / "config.json")
    assert config.architecture == "Qwen3_5ForConditionalGeneration" and not config.text.tie_word_embeddings
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" in names and "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert "model.language_model.layers.1.self_attn.q_proj.weight" in names
    assert not any("deepstack" in name for name in names)
    # The multi-token-prediction head as published, and the config key saying its layers.
    assert {"mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.norm.weight"} <= names.keys()
    assert config.family_config.mtp_num_hidden_layers == 1
    Harness(out)  # every published name loads into the model, and the model has no weight left unloaded


def test_a_failed_step_fails_its_requests_frees_their_state_and_the_engine_goes_on(
    tiny35_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raised may have moved some recurrent states on already; running its requests
    again would apply those tokens twice, so all of them fail, and nothing leaks."""
    from vlmserve import LLM, SamplingParams

    llm = LLM(tiny35_dir, dtype="float32", max_model_len=512, kv_cache_memory_gib=0.01)
    prompts = ["The capital of France", "One two three"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]

    sampler = llm.llm_engine.runner.sampler
    original = type(sampler).__call__
    calls = [0]

    def failing(self, logits, params, *rest):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 3:  # both requests have state by then
            raise RuntimeError("injected sampler failure")
        return original(self, logits, params, *rest)

    monkeypatch.setattr(type(sampler), "__call__", failing)
    outputs = llm.generate(prompts, params)
    assert [(o.finished, o.outputs[0].finish_reason) for o in outputs] == [(True, "abort")] * 2
    engine = llm.llm_engine
    slots = engine.kv.groups[0].slots
    assert slots.num_free == slots.num_slots and engine.kv.usage == 0.0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == alone
