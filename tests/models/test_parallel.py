"""Tensor parallelism on the model side (models/parallel.py and the families using it).

The end-to-end test runs the whole offline engine SPMD on a 2-rank gloo group on loopback (every
rank the same LLM on the same prompts) for the four tiny checkpoints and compares rank 0 with a
single-process LLM. At tensor_parallel_size 1 the layers are the plain ones: the transformers
parity tests (tests/models/test_qwen2_vl.py, test_qwen2_5_vl.py, test_qwen3_vl.py) guard that."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.models.tp_spmd import run_checkpoint
from vlmserve.attention import TorchAttentionBackend
from vlmserve.distributed import simulated_tensor_parallel
from vlmserve.families.qwen2_vl.tiny import TinySpec, _config, random_weights
from vlmserve.families.qwen3_5.tiny import TinySpec as Qwen35Spec
from vlmserve.families.qwen3_5.tiny import config_json as qwen3_5_config
from vlmserve.models.parallel import VocabParallelEmbedding, head_parts
from vlmserve.registry import family_of, parse_model_config

REPO = Path(__file__).resolve().parents[2]
QWEN_VL_CHAT = REPO / "tests" / "fixtures" / "qwen_vl_chat" / "config.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_ranks_spmd_match_one_process(
    tiny_dir: Path, tiny25_dir: Path, tiny3_dir: Path, tiny3_moe_dir: Path, tmp_path: Path
) -> None:
    dirs = [str(d) for d in (tiny_dir, tiny25_dir, tiny3_dir, tiny3_moe_dir)]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    logs = [(tmp_path / f"{r}.log").open("w") for r in range(2)]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.models.tp_spmd", str(r), "2", str(port), str(tmp_path / f"{r}.json"), *dirs],
            cwd=REPO,
            env=env,
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    try:
        # The single-process runs while the group works.
        single = {d: run_checkpoint(d) for d in dirs}
        deadline = time.monotonic() + 300
        # A rank that fails leaves the other waiting in a collective: stop at the first failure.
        while any(p.poll() is None for p in ranks) and all(p.poll() in (None, 0) for p in ranks):
            assert time.monotonic() < deadline, "the tensor-parallel group did not finish in 300 s"
            with contextlib.suppress(subprocess.TimeoutExpired):
                next(p for p in ranks if p.poll() is None).wait(timeout=1)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    # A rank that failed by itself first (the others were killed here).
    for r in sorted(range(2), key=lambda r: ranks[r].returncode < 0):
        assert ranks[r].returncode == 0, f"rank {r} failed:\n{(tmp_path / f'{r}.log').read_text()[-3000:]}"
    rank0, rank1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2))
    for d in dirs:
        one, tp0, tp1 = single[d], rank0[d], rank1[d]
        assert tp0["tokens"] == one["tokens"], d
        assert tp1["tokens"] == tp0["tokens"], d
        assert len({tuple(t) for t in one["tokens"]}) == len(one["tokens"])  # the prompts really differ
        # [prompt, step, top 5]
        torch.testing.assert_close(torch.tensor(tp0["logprobs"]), torch.tensor(one["logprobs"]), atol=1e-4, rtol=0)
        # Each rank holds half of every sharded weight and all of the rest (norms, patch
        # embedding, Qwen3-VL's position grid, q/k norms, the MoE router, row-parallel biases).
        total, replicated = one["param_bytes"], one["replicated_bytes"]
        assert replicated < 0.01 * total
        for tp in (tp0, tp1):
            assert tp["replicated_bytes"] == replicated
            assert tp["param_bytes"] == (total - replicated) // 2 + replicated, d


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
