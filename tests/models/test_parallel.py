"""Tensor parallelism on the model side (models/parallel.py and the families using it): which
slice of each checkpoint tensor a rank holds, a vocabulary padded on the last rank, head counts
that do not divide refused.

The end-to-end check, LLM(tensor_parallel_size=2) (two gloo rank processes on loopback) against a
single-process LLM for every family that shards, and the refusal of every family that does not,
is the families' conformance suite's (tests/families/test_conformance.py). At
tensor_parallel_size 1 the layers are the plain ones: the suite's checks against transformers
guard that."""

from __future__ import annotations

import pytest
import torch

from vlmserve.attention import TorchAttentionBackend
from vlmserve.distributed import simulated_tensor_parallel
from vlmserve.families.qwen2_vl.tiny import TinySpec, _config, random_weights
from vlmserve.models.parallel import VocabParallelEmbedding, head_parts
from vlmserve.registry import family_of, parse_model_config


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
