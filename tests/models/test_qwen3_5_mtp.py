"""Qwen3.5's multi-token-prediction head (vlmserve/families/qwen3_5/mtp.py) against a plain-torch
reference written here from the published structure, reading the checkpoint's tensors directly;
its loading, its refusals, and that it is built (with its KV layer) only when asked for."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from vlmserve.attention import select_backend
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.engine.model_runner import ModelRunner
from vlmserve.models.base import VLModel
from vlmserve.models.build import build_model
from vlmserve.registry import family_of, load_model_config

CPU = torch.device("cpu")
BLOCK_SIZE = 4


def build(model_dir: Path, draft_head: bool = False) -> VLModel:
    config = load_model_config(model_dir / "config.json")
    return build_model(
        family_of(config).model_class,
        config,
        model_dir,
        select_backend(CPU),
        CPU,
        torch.float32,
        draft_head=draft_head,
    )


# -- the reference ----------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMS norm: scaled by (1 + weight)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def swiglu(w: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    gate, up, down = (w[f"{p}{name}_proj.weight"] for name in ("gate", "up", "down"))
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def mlp(w: dict[str, torch.Tensor], p: str, x: torch.Tensor, top_k: int) -> torch.Tensor:
    """A SwiGLU MLP, or Qwen3.5-MoE's block: the top_k of a softmax router renormalised, each
    token through its experts one by one, plus the shared expert scaled by sigmoid(gate)."""
    if p + "gate.weight" not in w:
        return swiglu(w, p, x)
    probs = torch.softmax(x @ w[p + "gate.weight"].T, dim=-1)
    out = torch.sigmoid(x @ w[p + "shared_expert_gate.weight"].T) * swiglu(w, p + "shared_expert.", x)
    for row in range(x.shape[0]):
        weights, experts = probs[row].topk(top_k)
        for weight, e in zip(weights / weights.sum(), experts.tolist(), strict=True):
            out[row] += weight * swiglu(w, f"{p}experts.{e}.", x[row])
    return out


def mrope(positions: torch.Tensor, rotary_dim: int, theta: float, section: list[int]) -> tuple[torch.Tensor, ...]:
    """Interleaved M-RoPE: frequency j rotates by the temporal position, except the j = 1 mod 3
    of the first 3 * section[1] (height) and the j = 2 mod 3 of the first 3 * section[2] (width).
    positions [3, n] -> cos, sin [n, rotary_dim] (each frequency twice, halves rotated)."""
    half = rotary_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    axis = torch.zeros(half, dtype=torch.long)
    axis[1 : 3 * section[1] : 3] = 1
    axis[2 : 3 * section[2] : 3] = 2
    angles = positions.T[:, axis].double() * inv_freq  # [n, half]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim]: its first cos.shape[-1] dimensions rotated (rotate-half pairs)."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    first, second = rot[..., : r // 2], rot[..., r // 2 :]
    turned = torch.cat([-second, first], dim=-1)
    return torch.cat([rot * cos[:, None] + turned * sin[:, None], rest], dim=-1)


def reference_head(
    w: dict[str, torch.Tensor], text: dict, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The MTP head over one whole sequence [n] (causal attention over its rows): vLLM's
    Qwen3_5MultiTokenPredictor.forward, from the published tensors."""
    eps, d, rope = text["rms_norm_eps"], text["head_dim"], text["rope_parameters"]
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    n = token_ids.shape[0]
    embed = w["model.language_model.embed_tokens.weight"][token_ids]  # the target's embedding
    embed = rms_norm(embed, w["mtp.pre_fc_norm_embedding.weight"], eps)
    x = torch.cat([embed, rms_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1) @ w["mtp.fc.weight"].T
    p = "mtp.layers.0."
    h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
    q_gate = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, 2 * d)
    q, gate = q_gate[..., :d], q_gate[..., d:]
    k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, d)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, d)
    cos, sin = mrope(positions, int(d * rope["partial_rotary_factor"]), rope["rope_theta"], rope["mrope_section"])
    q = rotate(rms_norm(q, w[p + "self_attn.q_norm.weight"], eps), cos, sin)
    k = rotate(rms_norm(k, w[p + "self_attn.k_norm.weight"], eps), cos, sin)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))  # query head i reads kv head i // group
    scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    x = x + (attn * torch.sigmoid(gate.reshape(n, heads * d))) @ w[p + "self_attn.o_proj.weight"].T
    h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
    x = x + mlp(w, p + "mlp.", h, text.get("num_experts_per_tok", 0))
    return rms_norm(x, w["mtp.norm.weight"], eps)


def checkpoint(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    (file,) = model_dir.glob("*.safetensors")
    text = json.loads((model_dir / "config.json").read_text())["text_config"]
    return {name: t.float() for name, t in load_file(file).items()}, text


# -- the head against it ------------------------------------------------------------------------


def steps_of_two_sequences(model: VLModel, hidden_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two sequences of MTP rows (7 and 4) in two steps, as the engine lays a step out: first 5 and
    3 rows (prefill), then 2 and 1 (a verify-shaped step beside a decode-shaped one), each row
    writing its K/V where the target's row at that position does. Per sequence: its rows' inputs
    (token ids, hidden, positions with distinct temporal, height and width rows) and outputs."""
    generator = torch.Generator().manual_seed(0)
    lengths, splits = (7, 4), ((5, 2), (3, 1))
    block_tables = torch.tensor([[1, 2], [3, 5]])  # in a pool of 8 blocks of 4
    vocab = model.config.text.vocab_size
    inputs = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=generator)
        hidden = torch.randn(n, hidden_size, generator=generator)
        t = torch.arange(n) + 2
        positions = torch.stack([t, t * 2 + 1, t * 3 + 5])  # [3, n]
        inputs.append((ids, hidden, positions))
    outputs: list[list[torch.Tensor]] = [[], []]
    done = [0, 0]
    for step in range(2):
        rows = [(s, range(done[s], done[s] + splits[s][step])) for s in range(2)]
        slots = [int(block_tables[s, i // BLOCK_SIZE]) * BLOCK_SIZE + i % BLOCK_SIZE for s, r in rows for i in r]
        ends = [r.stop for _, r in rows]
        loc = [0, len(rows[0][1]), len(rows[0][1]) + len(rows[1][1])]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_tables=block_tables,
            seq_lens=torch.tensor(ends),
            query_start_loc=loc,
            seq_lens_host=ends,
            block_size=BLOCK_SIZE,
        )
        ids = torch.cat([inputs[s][0][r.start : r.stop] for s, r in rows])
        hidden = torch.cat([inputs[s][1][r.start : r.stop] for s, r in rows])
        positions = torch.cat([inputs[s][2][:, r.start : r.stop] for s, r in rows], dim=1)
        with torch.inference_mode():
            out = model.draft_forward(ids, hidden, positions, meta)
        assert out.shape == (loc[-1], hidden_size)
        for s, _ in rows:
            outputs[s].append(out[loc[s] : loc[s + 1]])
        done = ends
    return [(inputs[s], outputs[s]) for s in range(2)]  # type: ignore[misc]


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_draft_forward_is_the_published_head_over_the_kv_of_earlier_steps(
    which: str, tiny35_dir: Path, tiny35_moe_dir: Path
) -> None:
    model_dir = tiny35_dir if which == "dense" else tiny35_moe_dir
    model = build(model_dir, draft_head=True)
    runner = ModelRunner(model, CPU, torch.float32)
    runner.bind_kv_cache(num_blocks=8, block_size=BLOCK_SIZE)
    weights, text = checkpoint(model_dir)
    lm_head = weights.get("lm_head.weight", weights["model.language_model.embed_tokens.weight"])  # tied or not
    for (ids, hidden, positions), outputs in steps_of_two_sequences(model, text["hidden_size"]):
        expected = reference_head(weights, text, ids, hidden, positions)
        # Each step's rows attend to the K/V the earlier step wrote: the reference's rows over the
        # whole sequence so far (causal, so later rows change nothing before them).
        torch.testing.assert_close(torch.cat(outputs), expected, rtol=1e-4, atol=1e-4)
        # The logits come from the target's lm_head.
        last = outputs[-1]
        torch.testing.assert_close(model.compute_logits(last), expected[-len(last) :] @ lm_head.T, rtol=1e-4, atol=1e-4)


def test_the_head_is_built_with_its_kv_layer_only_when_asked(tiny35_dir: Path, tiny_dir: Path) -> None:
    plain, headed = build(tiny35_dir), build(tiny35_dir, draft_head=True)
    assert not plain.has_draft_head and headed.has_draft_head
    assert not any(name.startswith("mtp.") for name, _ in plain.named_parameters())
    text = plain.config.text
    per_layer = 2 * text.num_key_value_heads * text.head_dim * 4  # K and V, float32
    plain_runner, headed_runner = ModelRunner(plain, CPU, torch.float32), ModelRunner(headed, CPU, torch.float32)
    # Two full-attention layers in the decoder (linear, full, linear, full); the head's is a third.
    assert (len(plain_runner.attention_layers), plain_runner.kv_bytes_per_token) == (2, 2 * per_layer)
    assert (len(headed_runner.attention_layers), headed_runner.kv_bytes_per_token) == (3, 3 * per_layer)
    meta = AttentionMetadata(torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]), [0, 1], [1], BLOCK_SIZE)
    one = (torch.tensor([5]), torch.zeros(1, text.hidden_size), torch.zeros(3, 1, dtype=torch.long), meta)
    with pytest.raises(NotImplementedError, match="Qwen3.5 was built without its multi-token-prediction head"):
        plain.draft_forward(*one)
    # A family without a head: refused when asked for one, and its draft_forward names it.
    with pytest.raises(ValueError, match=f"checkpoint {tiny_dir}: Qwen2VLForConditionalGeneration has no draft head"):
        build(tiny_dir, draft_head=True)
    with pytest.raises(NotImplementedError, match="Qwen2VLForConditionalGeneration has no draft head"):
        build(tiny_dir).draft_forward(*one)


def test_the_moe_heads_experts_load_from_the_published_names(tiny35_moe_dir: Path) -> None:
    model = build(tiny35_moe_dir, draft_head=True)
    weights, text = checkpoint(tiny35_moe_dir)
    mi = text["moe_intermediate_size"]
    mlp_ = model.mtp.layers[0].mlp  # type: ignore[union-attr,index]
    stacked = dict(mlp_.named_parameters())["experts.gate_up_proj"]
    assert stacked.shape[0] == text["num_experts"]
    assert torch.equal(stacked[4, mi:], weights["mtp.layers.0.mlp.experts.4.up_proj.weight"])
    assert torch.equal(mlp_.shared_expert_gate.weight, weights["mtp.layers.0.mlp.shared_expert_gate.weight"])


def copy_of(model_dir: Path, dest: Path, drop: str = "", add: str = "", config: dict | None = None) -> Path:
    """The checkpoint copied without the tensors whose names start with `drop`, with a tensor
    `add` (a norm's scale), or with text_config fields changed."""
    shutil.copytree(model_dir, dest)
    (file,) = dest.glob("*.safetensors")
    tensors = {name: t for name, t in load_file(file).items() if not (drop and name.startswith(drop))}
    if add:
        tensors[add] = torch.zeros(tensors["mtp.norm.weight"].shape, dtype=tensors["mtp.norm.weight"].dtype)
    save_file(tensors, file, metadata={"format": "pt"})
    raw = json.loads((dest / "config.json").read_text())
    raw["text_config"].update(config or {})
    (dest / "config.json").write_text(json.dumps(raw))
    return dest


def test_a_checkpoint_without_the_head_or_part_of_it_is_refused_by_name(tiny35_dir: Path, tmp_path: Path) -> None:
    bare = copy_of(tiny35_dir, tmp_path / "bare", drop="mtp.")
    build(bare)  # without the head it loads as before
    with pytest.raises(ValueError, match=f"checkpoint {bare}: the checkpoint has no multi-token-prediction head"):
        build(bare, draft_head=True)
    k_norm = "mtp.layers.0.self_attn.k_norm.weight"
    partial = copy_of(tiny35_dir, tmp_path / "partial", drop=k_norm)
    with pytest.raises(ValueError, match=rf"{partial}: checkpoint lacks weights: \['{k_norm}'\]"):
        build(partial, draft_head=True)
    extra = copy_of(tiny35_dir, tmp_path / "extra", add="mtp.layers.1.input_layernorm.weight")
    with pytest.raises(ValueError, match=r"does not have: \['mtp.layers.1.input_layernorm.weight'\]"):
        build(extra, draft_head=True)


@pytest.mark.parametrize("layers", [0, 2])
def test_a_head_of_other_than_one_layer_is_refused_when_asked(layers: int, tiny35_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_of(tiny35_dir, tmp_path / "c", config={"mtp_num_hidden_layers": layers})
    assert not build(model_dir).has_draft_head
    with pytest.raises(ValueError, match=f"text_config.mtp_num_hidden_layers is {layers}; vlmserve runs .* of 1 layer"):
        build(model_dir, draft_head=True)
