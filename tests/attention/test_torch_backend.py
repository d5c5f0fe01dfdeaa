"""The torch attention backend's verify rows (attention/metadata.py: decode_row_lens): a sequence's
few new tokens after cached ones attend as decode rows, each over its own prefix, and give what
decode steps of those tokens one at a time give; longer runs, and sequences with nothing cached,
attend as chunks."""

from __future__ import annotations

import pytest
import torch

from vlmserve.attention import select_backend
from vlmserve.attention.metadata import MAX_DECODE_ROWS_PER_SEQ, AttentionMetadata, decode_row_lens
from vlmserve.attention.torch_backend import TorchAttentionBackend

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 32, 16


def _meta(q_lens: list[int], seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    slots = [
        tables[i][t // BLOCK] * BLOCK + t % BLOCK
        for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True))
        for t in range(seq_len - q_len, seq_len)
    ]
    loc = [0]
    for q_len in q_lens:
        loc.append(loc[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=loc,
        seq_lens_host=seq_lens,
        block_size=BLOCK,
    )


def test_decode_row_lens_are_each_tokens_own_prefix() -> None:
    assert decode_row_lens(1, 41) == [41]  # a decode step's token
    assert decode_row_lens(5, 45) == [41, 42, 43, 44, 45]  # a verify step's k + 1 = 5 after 40 cached
    assert decode_row_lens(5, 5) is None  # nothing cached before them: a chunk
    assert decode_row_lens(1, 1) is None
    assert decode_row_lens(MAX_DECODE_ROWS_PER_SEQ + 1, 100) is None  # a longer run: a chunk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu kernels", "sdpa"])
def test_verify_rows_give_what_decoding_each_token_alone_gives(dtype: torch.dtype, kernels: bool) -> None:
    """Sequences with 3 new tokens after 37 cached, 1 after 20, 4 after 50 and 6 with nothing
    cached (a chunk): each verify row equals a decode step of that token alone over the same
    cache (bit for bit where both run the CPU decode kernel; SDPA's masked batch within float
    rounding), and the chunk equals its causal attention."""
    backend = select_backend(torch.device("cpu")) if kernels else TorchAttentionBackend()
    if kernels and backend.decode_kernel is None:
        pytest.skip("the CPU kernels do not build here")
    g = torch.Generator().manual_seed(0)
    q_lens, seq_lens = [3, 1, 4, 6], [40, 21, 54, 6]
    tables = [[0, 1, 2, 0], [3, 4, 0, 0], [5, 6, 7, 8], [9, 0, 0, 0]]
    cache = torch.randn(2, 10, BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
    n = sum(q_lens)
    q = torch.randn(n, HEADS, DIM, generator=g).to(dtype)
    k, v = (torch.randn(n, KV_HEADS, DIM, generator=g).to(dtype) for _ in range(2))
    out = backend.paged_attention(q, k, v, cache, _meta(q_lens, seq_lens, tables), DIM**-0.5)
    row = 0
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for j in range(q_len):
            if q_len == seq_len:  # the chunk: causal attention over its own keys
                keys, values = k[row - j : row - j + q_len], v[row - j : row - j + q_len]
                expected = torch.nn.functional.scaled_dot_product_attention(
                    q[row - j : row - j + q_len].float().transpose(0, 1),
                    keys.float().repeat_interleave(2, 1).transpose(0, 1),
                    values.float().repeat_interleave(2, 1).transpose(0, 1),
                    is_causal=True,
                    scale=DIM**-0.5,
                ).transpose(0, 1)[j]
                torch.testing.assert_close(out[row].float(), expected, atol=2e-2, rtol=2e-2)
            else:  # the token decoded alone: its K/V written, attending over its seq_len - q_len + j + 1
                alone = _meta([1], [seq_len - q_len + j + 1], [tables[i]])
                expected = backend.paged_attention(q[row : row + 1], k[row : row + 1], v[row : row + 1], cache, alone,
                                                   DIM**-0.5)[0]  # fmt: skip
                if kernels:
                    assert torch.equal(out[row], expected), (i, j)
                else:  # bf16: a rounding step apart at most
                    tol = 1e-5 if dtype == torch.float32 else 1e-2
                    torch.testing.assert_close(out[row], expected, atol=tol, rtol=tol)
            row += 1
