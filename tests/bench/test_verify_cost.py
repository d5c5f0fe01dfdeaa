"""The verify-step benchmark (vlmserve.bench.verify_cost) on a tiny checkpoint: its table has a row
per (k, batch), with times measured, and its verify step is the rows it says (k + 1 per request)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlmserve.bench import verify_cost
from vlmserve.entrypoints.llm import LLM


def test_the_table_has_a_row_per_k_and_batch(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    verify_cost.main([str(tiny_dir), "--batch", "2", "--k", "1", "3", "--context", "24", "--rounds", "1",
                      "--steps", "1", "--dtype", "float32"])  # fmt: skip
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [cells[:2] for cells in rows[2:]] == [[" 1 ", " 2 "], [" 3 ", " 2 "]]  # after the header lines
    assert all(float(cell) > 0 for cells in rows[2:] for cell in cells[2:])


def test_a_verify_step_computes_k_plus_one_rows_per_request(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir, dtype="float32", max_model_len=128, enable_prefix_caching=False, kv_cache_memory_gib=0.01)
    states = verify_cost.prefilled_requests(llm, 3, 24, 4, seed=0)
    prompts = {s.request_id: list(s.token_ids) for s in states}
    logits = verify_cost.step_logits(llm, states, prompts, 24, 5)
    assert logits.shape == (15, llm.llm_engine.model_config.text.vocab_size)
    # request 1's rows are its own: the same step for it alone gives them
    alone = verify_cost.step_logits(llm, states[1:2], prompts, 24, 5)
    torch.testing.assert_close(logits[5:10], alone, atol=1e-4, rtol=1e-4)
