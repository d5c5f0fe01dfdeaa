"""Decode steps through DecodeGraphs' persistent buffers, on the CPU: the capture is injected as
one that re-runs the captured function (what a CUDA graph replay does, reading the same buffers),
with the triton backend under the Triton interpreter (the backend graphs are captured with)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from vlmserve.attention import select_backend
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.engine.cuda_graphs import DecodeGraphs, batch_size_buckets
from vlmserve.models.build import build_model
from vlmserve.registry import family_of, load_model_config


def test_buckets() -> None:
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(6) == [1, 2, 4, 6]
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_size_buckets(64) == [1, 2, 4, *range(8, 65, 8)]


def eager_capture(captured: list[int]) -> Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]:
    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        captured.append(fn().shape[0])  # the warm-up / capture run
        return fn

    return capture


@torch.inference_mode()
def test_a_padded_decode_step_equals_the_eager_step_and_writes_only_its_slots(
    triton_interpreter: None, tiny_dir: Path
) -> None:
    config = load_model_config(tiny_dir / "config.json")
    backend = select_backend(torch.device("cpu"), "triton")
    model = build_model(family_of(config).model_class, config, tiny_dir, backend, torch.device("cpu"), torch.float32)
    layers = [m for m in model.modules() if hasattr(m, "kv_cache")]
    num_blocks, block_size, scratch = 12, 16, 12  # the scratch block follows the pool's 12
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, num_blocks + 1, block_size, m.num_kv_heads, m.head_dim, generator=g) for m in layers]

    captured: list[int] = []
    for layer, cache in zip(layers, caches, strict=True):
        layer.kv_cache = cache.clone()
    graphs = DecodeGraphs(model, torch.device("cpu"), 4, 3, block_size, scratch, eager_capture(captured))
    assert captured == [4, 2, 1]  # largest first
    # A step of four requests (bucket 4, full), then one of three (bucket 4: the padded row's
    # buffers still hold the fourth request's inputs), each also run eagerly on its own cache.
    seq_lens = [5, 20, 40, 9]
    block_rows = [[7], [2, 9], [0, 11, 4], [5]]
    slots = [
        row[(n - 1) // block_size] * block_size + (n - 1) % block_size
        for row, n in zip(block_rows, seq_lens, strict=True)
    ]
    token_ids = [1000, 2000, 3000, 4000]
    positions = torch.tensor([[4, 19, 39, 8]] * 3)

    def eager(n: int) -> torch.Tensor:
        block_tables = torch.zeros(n, 3, dtype=torch.long)
        for i, row in enumerate(block_rows[:n]):
            block_tables[i, : len(row)] = torch.tensor(row)
        lens = seq_lens[:n]
        meta = AttentionMetadata(
            torch.tensor(slots[:n]), block_tables, torch.tensor(lens), list(range(n + 1)), lens, 16
        )
        return model(None, positions[:, :n], meta, model.get_input_embeddings(torch.tensor(token_ids[:n])), None)

    for layer, cache in zip(layers, caches, strict=True):
        layer.kv_cache = cache.clone()
    graphs.run(token_ids, positions, slots, seq_lens, block_rows)
    got = graphs.run(token_ids[:3], positions[:, :3], slots[:3], seq_lens[:3], block_rows[:3])
    graph_caches = [layer.kv_cache.clone() for layer in layers]

    for layer, cache in zip(layers, caches, strict=True):
        layer.kv_cache = cache.clone()
    eager(4)
    expected = eager(3)

    assert got.shape == expected.shape == (3, config.text.hidden_size)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for graph_cache, layer in zip(graph_caches, layers, strict=True):
        # The same K/V written at the requests' slots (up to the projections' rounding: a batch of
        # 4 rows, not 3); the padded row wrote to the scratch block only.
        torch.testing.assert_close(graph_cache[:, :num_blocks], layer.kv_cache[:, :num_blocks], atol=1e-5, rtol=1e-5)
        assert not torch.equal(graph_cache[:, scratch], layer.kv_cache[:, scratch])


@pytest.mark.parametrize("bad", [0.0, 1.5])
def test_enforce_eager_and_gpu_memory_utilization_flags_parse(bad: float) -> None:
    import argparse

    from vlmserve.api.options import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--enforce-eager", "--gpu-memory-utilization", "0.5", "--attention-backend", "triton"])
    assert (args.enforce_eager, args.gpu_memory_utilization, args.attention_backend) == (True, 0.5, "triton")
    with pytest.raises(SystemExit):
        parser.parse_args(["--gpu-memory-utilization", str(bad)])


@torch.inference_mode()
def test_a_verify_step_replays_the_decode_graphs_as_decode_rows(triton_interpreter: None, tiny_dir: Path) -> None:
    """A verify step (one request's token and 3 drafts after 16 cached tokens, beside another's
    decode) as the runner hands it to the decode graphs, each token a decode row over its own
    prefix (StepBatch.decode_rows): the hidden states and K/V of the eager step that runs the 4
    tokens as one chunk."""
    from vlmserve.engine.step_batch import StepBatch

    config = load_model_config(tiny_dir / "config.json")
    backend = select_backend(torch.device("cpu"), "triton")
    model = build_model(family_of(config).model_class, config, tiny_dir, backend, torch.device("cpu"), torch.float32)
    layers = [m for m in model.modules() if hasattr(m, "kv_cache")]
    num_blocks, block_size = 12, 16
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(2, num_blocks + 1, block_size, m.num_kv_heads, m.head_dim, generator=g) for m in layers]
    seq_lens, block_rows, counts = [20, 9], [[3, 8], [5]], [4, 1]
    starts = [n - c for n, c in zip(seq_lens, counts, strict=True)]
    slots = [
        row[t // block_size] * block_size + t % block_size
        for row, start, n in zip(block_rows, starts, seq_lens, strict=True)
        for t in range(start, n)
    ]
    token_ids = [1000, 2000, 3000, 4000, 5000]
    positions = torch.tensor([[16, 17, 18, 19, 8]] * 3)
    batch = StepBatch(token_ids, positions, slots, [0, 4, 5], seq_lens, block_rows, [], [], [], [])
    rows = batch.decode_rows()
    assert rows == ([17, 18, 19, 20, 9], [[3, 8]] * 4 + [[5]])

    for layer, cache in zip(layers, caches, strict=True):
        layer.kv_cache = cache.clone()
    graphs = DecodeGraphs(model, torch.device("cpu"), 8, 2, block_size, num_blocks, eager_capture([]))
    got = graphs.run(token_ids, positions, slots, *rows)
    graph_caches = [layer.kv_cache.clone() for layer in layers]

    for layer, cache in zip(layers, caches, strict=True):
        layer.kv_cache = cache.clone()
    block_tables = torch.tensor([[3, 8], [5, 0]])
    meta = AttentionMetadata(torch.tensor(slots), block_tables, torch.tensor(seq_lens), [0, 4, 5], seq_lens, 16)
    expected = model(None, positions, meta, model.get_input_embeddings(torch.tensor(token_ids)), None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for graph_cache, layer in zip(graph_caches, layers, strict=True):
        torch.testing.assert_close(graph_cache[:, :num_blocks], layer.kv_cache[:, :num_blocks], atol=1e-5, rtol=1e-5)
    # a prompt's chunk (no token cached before it) is not a decode-row shape
    chunk = StepBatch(token_ids[:4], positions[:, :4], slots[:4], [0, 4], [4], [[3]], [], [], [], [])
    assert chunk.decode_rows() is None
