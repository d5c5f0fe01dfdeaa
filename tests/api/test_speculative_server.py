"""Speculative decoding served: `--speculative-config` as vLLM takes it, the answers those of a
server without it (the official openai client), vLLM's spec_decode counters in /metrics, each
response's acceptance in its `vlmserve` extension, and a flag that is wrong refused at start."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.conftest import Server, start_server

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Prompts whose greedy answers on the tiny checkpoint repeat themselves (drafts get accepted).
PROMPTS = ["Hello", "The sea, the sea, the grey sea", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def speculative_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tiny_dir, tmp_path_factory.mktemp("speculative"), "--speculative-config", json.dumps(NGRAM))
    yield s
    s.stop()


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


def answer(client: openai.OpenAI, prompt: str) -> tuple[list[int], dict]:
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=40,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    extra = reply.choices[0].model_extra or {}
    return extra["token_ids"], (reply.model_extra or {})["vlmserve"]


def metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))


def test_answers_are_a_plain_servers_and_the_acceptance_is_reported(speculative_server: Server, server: Server) -> None:
    plain, speculative = client_of(server), client_of(speculative_server)
    drafted = accepted = 0
    for prompt in PROMPTS:
        expected, _ = answer(plain, prompt)
        got, extension = answer(speculative, prompt)
        assert got == expected, prompt
        (mine,) = extension.get("speculative", [{"num_draft_tokens": 0, "num_accepted_tokens": 0}])
        drafted += mine["num_draft_tokens"]
        accepted += mine["num_accepted_tokens"]
        if mine["num_draft_tokens"]:
            assert mine["acceptance_rate"] == pytest.approx(mine["num_accepted_tokens"] / mine["num_draft_tokens"])
    assert accepted > 0 and drafted >= accepted
    text = httpx.get(speculative_server.url + "/metrics", timeout=10).text
    assert metric(text, "vllm:spec_decode_num_draft_tokens_total") == drafted
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_total") == accepted
    assert 0 < metric(text, "vllm:spec_decode_num_drafts_total") <= drafted
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted  # over the positions


def test_a_wrong_speculative_config_stops_the_server_at_start_naming_it(tiny_dir: Path) -> None:
    wrong = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2})
    command = [sys.executable, "-m", "vlmserve.entrypoints.cli", "serve", str(tiny_dir), "--speculative-config", wrong]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "prompt_lookup_min (5) is above prompt_lookup_max (2)" in done.stderr
