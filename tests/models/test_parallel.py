"""Tensor parallelism on the model side (models/parallel.py and the families using it).

The end-to-end test runs LLM(tensor_parallel_size=2) (two gloo rank processes on loopback) for the
four tiny checkpoints and compares it with a single-process LLM. At tensor_parallel_size 1 the
layers are the plain ones: the transformers parity tests (tests/models/test_qwen2_vl.py,
test_qwen2_5_vl.py, test_qwen3_vl.py) guard that."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import random_image
from vlmserve import LLM, SamplingParams
from vlmserve.attention import TorchAttentionBackend
from vlmserve.distributed import simulated_tensor_parallel
from vlmserve.engine.executor import MultiprocExecutor
from vlmserve.families.qwen2_vl.tiny import TinySpec, _config, random_weights
from vlmserve.families.qwen3_5.tiny import TinySpec as Qwen35Spec
from vlmserve.families.qwen3_5.tiny import config_json as qwen3_5_config
from vlmserve.models.parallel import VocabParallelEmbedding, head_parts, spec_of
from vlmserve.registry import family_of, parse_model_config

REPO = Path(__file__).resolve().parents[2]
QWEN_VL_CHAT = REPO / "tests" / "fixtures" / "qwen_vl_chat" / "config.json"


PAD = "<|vision_start|><|image_pad|><|vision_end|>"
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 1024,
    "kv_cache_memory_gib": 0.01,
    "limit_mm_per_prompt": {"image": 2},
}
PARAMS = SamplingParams(temperature=0, max_tokens=4, logprobs=5)


def chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def prompts() -> list[Any]:
    wide, tall, small = random_image(150, 100, seed=1), random_image(70, 190, seed=2), random_image(40, 30, seed=3)
    return [
        {"prompt": chat(f"{PAD}What is in this image?"), "multi_modal_data": {"image": [wide]}},
        {"prompt": chat(f"{PAD}{PAD}Which is darker?"), "multi_modal_data": {"image": [tall, small]}},
        chat("Tell me a story about a lighthouse."),
    ]


def results(outputs: list[Any]) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens and, per prompt and step, the top-5 logprobs, best first."""
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[sorted(v.logprob for v in step.values()) for step in o.outputs[0].logprobs] for o in outputs]
    return tokens, torch.tensor(logprobs)


def parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of all parameters, bytes of those every rank holds whole: no ShardSpec)."""
    total = replicated = 0
    seen: set[int] = set()  # a tied lm_head is the embedding's parameter: counted once
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = p.numel() * p.element_size()
            total += n
            replicated += n if spec_of(module, name) is None else 0
    return total, replicated


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["tiny_dir", "tiny25_dir", "tiny3_dir", "tiny3_moe_dir"])
def test_two_ranks_match_one_process(checkpoint: str, request: pytest.FixtureRequest) -> None:
    """LLM(tensor_parallel_size=2): two gloo rank processes, each holding its shard, give the
    single process's greedy tokens (which the parity tests hold to transformers') and logprobs,
    three prompts batched; each rank holds half of every sharded weight, measured in the rank."""
    model_dir = request.getfixturevalue(checkpoint)
    one = LLM(model_dir, **ENGINE)
    tokens, logprobs = results(one.generate(prompts(), PARAMS))
    total, replicated = parameter_bytes(one.llm_engine.model)
    del one
    gc.collect()
    assert len({tuple(t) for t in tokens}) == len(tokens)  # the prompts really differ
    two = LLM(model_dir, tensor_parallel_size=2, **ENGINE)
    try:
        tp_tokens, tp_logprobs = results(two.generate(prompts(), PARAMS))
        executor = two.llm_engine.core.executor
        assert isinstance(executor, MultiprocExecutor)
        ranks = executor.plan(None)
    finally:
        two.shutdown()
    assert tp_tokens == tokens
    torch.testing.assert_close(tp_logprobs, logprobs, atol=1e-4, rtol=0)
    # Every rank holds all of the rest (norms, patch embedding, Qwen3-VL's position grid, q/k
    # norms, the MoE router, row-parallel biases): under 1% here.
    assert replicated < 0.01 * total
    assert [r.weights_bytes for r in ranks] == [(total - replicated) // 2 + replicated] * 2


def build_rank(raw: dict, rank: int, size: int, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    config = parse_model_config(raw)
    with simulated_tensor_parallel(rank, size):
        with torch.device("meta"):
            model = family_of(config).model_class(config, TorchAttentionBackend())
        model = model.to_empty(device="cpu")
        model.tie_weights()
        model.load_weights(weights.items())
    return model


def test_shards_are_the_checkpoint_slices_kv_heads_replicated_past_their_count() -> None:
    """tp 4 over 4 query heads and 2 KV heads: rank r holds query head r and KV head r // 2."""
    spec = TinySpec(vision_num_heads=4)
    raw, weights = _config(spec, nested=False), random_weights(spec)
    hd = spec.hidden_size // spec.num_attention_heads
    v_dim = spec.vision_embed_dim
    for rank in range(4):
        model = build_rank(raw, rank, 4, weights)
        attn = model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        p = "model.layers.0.self_attn."
        q, k, v = (weights[p + f"{n}_proj.weight"] for n in "qkv")
        kv_rows = slice(rank // 2 * hd, (rank // 2 + 1) * hd)
        want = torch.cat([q[rank * hd : (rank + 1) * hd], k[kv_rows], v[kv_rows]])
        assert torch.equal(attn.qkv_proj.weight, want)
        qb, kb, vb = (weights[p + f"{n}_proj.bias"] for n in "qkv")
        assert torch.equal(attn.qkv_proj.bias, torch.cat([qb[rank * hd : (rank + 1) * hd], kb[kv_rows], vb[kv_rows]]))
        assert torch.equal(attn.o_proj.weight, weights[p + "o_proj.weight"][:, rank * hd : (rank + 1) * hd])
        # The vision tower's fused [q | k | v]: one head of each part.
        vision = model.visual.blocks[0].attn
        fused = weights["visual.blocks.0.attn.qkv.weight"]
        head = v_dim // 4
        rows = [part * v_dim + rank * head + i for part in range(3) for i in range(head)]
        assert torch.equal(vision.qkv.weight, fused[rows])
        assert torch.equal(vision.proj.bias, weights["visual.blocks.0.attn.proj.bias"])  # whole, added by rank 0
        assert vision.proj.bias_in_product == (rank == 0)
        vocab = weights["model.embed_tokens.weight"]
        rows_per_rank = vocab.shape[0] // 4
        assert torch.equal(model.model.embed_tokens.weight, vocab[rank * rows_per_rank : (rank + 1) * rows_per_rank])
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: the same shard


def test_a_vocabulary_not_divisible_is_padded_on_the_last_rank() -> None:
    table = torch.arange(15.0).view(5, 3)  # 5 tokens
    with simulated_tensor_parallel(1, 2):
        embedding = VocabParallelEmbedding(5, 3)
    assert (embedding.num_embeddings, embedding.vocab_start) == (3, 3)
    start, size, rows = embedding.tp_shards["weight"].narrow(table, None, 0)
    assert (start, size) == (0, 3)
    assert torch.equal(rows, torch.cat([table[3:], torch.zeros(1, 3)]))


def test_head_parts_refuse_what_does_not_divide() -> None:
    heads = "decoder's number of attention heads .4. is not divisible by tensor_parallel_size 3"
    with simulated_tensor_parallel(1, 3), pytest.raises(ValueError, match=heads):
        head_parts(4, 2, 16)
    kv_heads = "decoder's 3 key/value heads cannot be replicated evenly over tensor_parallel_size 4"
    with simulated_tensor_parallel(0, 4), pytest.raises(ValueError, match=kv_heads):
        head_parts(12, 3, 16)


@pytest.mark.parametrize(
    ("raw", "family"),
    [
        (json.loads(QWEN_VL_CHAT.read_text()), "Qwen-VL-Chat"),
        (qwen3_5_config(Qwen35Spec()), "Qwen3.5"),
    ],
)
def test_unsharded_families_refuse_tensor_parallel(raw: dict, family: str) -> None:
    config = parse_model_config(raw)
    with (
        simulated_tensor_parallel(0, 2),
        torch.device("meta"),
        pytest.raises(ValueError, match=f"{family}.*tensor parallelism"),
    ):
        family_of(config).model_class(config, TorchAttentionBackend())
    with torch.device("meta"):
        family_of(config).model_class(config, TorchAttentionBackend())  # tp 1 builds
