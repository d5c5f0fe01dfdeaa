"""The embeddings benchmark: its transformers side is the reference computation of
Qwen3-VL-Embedding (tests/reference_pooling.py), its inputs are what it says, and a run on the
tiny embedding checkpoint prints both engines' rates, the ratio and an agreement figure that is
float32-tight (a wrong prompt or pooling on either side would fail it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests import reference_pooling as ref
from vlmserve.bench.embed import cosine_distances, embedding_inputs, main, max_model_len_for
from vlmserve.registry import BY_NAME


@pytest.fixture(scope="module")
def embedding_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return BY_NAME["qwen3_vl"].write_tiny(tmp_path_factory.mktemp("ckpt") / "embedding", preset="embedding")


def test_inputs_are_distinct_deterministic_pictures_with_their_own_texts() -> None:
    first, again, other = (embedding_inputs(5, 64, seed) for seed in (1, 1, 2))
    assert [item["image"].size for item in first] == [(64, 64)] * 5
    assert len({item["text"] for item in first}) == 5
    pixels = [item["image"].tobytes() for item in first]
    assert pixels == [item["image"].tobytes() for item in again]  # deterministic
    assert len(set(pixels)) == 5  # each input its own picture
    assert not set(pixels) & {item["image"].tobytes() for item in other}  # a round's seed: new pictures


def test_max_model_len_holds_one_input() -> None:
    # 448 x 448: 14 x 14 tokens of 32 x 32 pixels, and the conversation around them.
    assert max_model_len_for(448) == 512
    assert max_model_len_for(64) == 256
    assert max_model_len_for(4096) == 2048  # the official script's 1800-token bound on an image


def test_the_transformers_side_is_the_reference_embedding(embedding_checkpoint: Path) -> None:
    """Its own prompts, resize, right padding and pooling equal the test suite's reference, in a
    batch of inputs of different lengths (padding matters) and different images."""
    from vlmserve.bench.embed_hf import TransformersEmbedder

    hf = TransformersEmbedder(embedding_checkpoint, torch.float32, torch.device("cpu"))
    items = embedding_inputs(3, 96, seed=3)
    items[1]["text"] += " A longer caption, so that the batch is padded on the right."
    ours = hf.embed(items)
    reference = ref.embed(
        hf.model,
        ref.load_tokenizer(embedding_checkpoint),
        hf.image_processor,
        [ref.Item(text=item["text"], images=(item["image"],)) for item in items],
    )
    assert ours.shape == (3, 64)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    assert float(cosine_distances(ours[:1], ours[1:2])[0]) > 1e-3  # the inputs differ


def test_benchmark_prints_both_rates_the_ratio_and_a_tight_agreement(
    embedding_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Steps of 64 tokens: the four prompts (over 30 tokens each) are split across steps (chunked prefill).
    args = ["--inputs", "4", "--image-size", "64", "--batch-sizes", "1,4,16", "--rounds", "1"]
    assert main([str(embedding_checkpoint), "--dtype", "float32", "--max-num-batched-tokens", "64", *args]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^cpu: .+ threads$", out, re.MULTILINE)  # the CPU named
    assert "4 inputs (a 64x64 image and a short text each), float32; vlmserve's steps of up to 64 tokens" in out
    rates = {
        name: float(rate)
        for name, rate in re.findall(r"^  (vlmserve|transformers batch \d+) +([\d.]+) embeddings/s", out, re.MULTILINE)
    }
    # 16 is more than the 4 inputs: not run.
    assert set(rates) == {"vlmserve", "transformers batch 1", "transformers batch 4"} and min(rates.values()) > 0
    best = re.search(r"transformers best +([\d.]+) embeddings/s +\((batch \d+)\)", out)
    assert best is not None
    assert float(best[1]) == max(rates["transformers batch 1"], rates["transformers batch 4"])
    assert float(best[1]) == rates[f"transformers {best[2]}"]
    ratio = re.search(r"ratio +([\d.]+)x", out)
    assert ratio is not None and float(ratio[1]) == pytest.approx(rates["vlmserve"] / float(best[1]), abs=0.01)
    distance = re.search(r"largest cosine distance between the engines' embeddings of an input: (\S+)", out)
    assert distance is not None and 0 <= float(distance[1]) < 1e-4


def test_batch_sizes_above_the_inputs_are_refused_with_the_numbers(
    embedding_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for bad, says in (
        (["--inputs", "2", "--batch-sizes", "4,8"], "no batch size in [4, 8] is at most --inputs 2"),
        (["--batch-sizes", "4,x"], "batch sizes are positive integers separated by commas, got '4,x'"),
        (["--batch-sizes", "0,4"], "batch sizes are positive integers separated by commas, got '0,4'"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([str(embedding_checkpoint), *bad])
        assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_a_checkpoint_of_another_family_is_refused_with_the_fix(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for model, says in ((tiny_dir, "a 'qwen2_vl' checkpoint"), (tmp_path, "has no config.json naming a model_type")):
        with pytest.raises(SystemExit) as exit_info:
            main([str(model), "--inputs", "2", "--batch-sizes", "1"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and says in err and "--preset embedding-bench" in err
