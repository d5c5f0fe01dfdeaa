"""Qwen-VL-Chat against the description of its remote code. The remote code is
not available here, so each stage is checked for the shapes and invariants the description states, and
the whole model against a dense transcription of the reference forward written below from the
description's formulas (with its KV cache of rotated keys and its cached ntk_alpha)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from tests.model_harness import Harness
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.engine.kv_cache import KVCacheManager
from vlmserve.engine.model_runner import ModelRunner
from vlmserve.entrypoints.cli import main as cli_main
from vlmserve.families.qwen_vl.config import qwen_vl_config
from vlmserve.families.qwen_vl.model import QwenRotaryEmbedding, apply_qwen_rotary, logn_factors, ntk_alpha
from vlmserve.families.qwen_vl.visual import resize_pos_embed
from vlmserve.ipc.contracts import NewRequestData, SchedulerOutput
from vlmserve.multimodal.inputs import MultiModalItem, ProcessedPrompt
from vlmserve.registry import load_model_config, parse_model_config
from vlmserve.sampling_params import SamplingParams

FIXTURE = Path(__file__).parent.parent / "fixtures" / "qwen_vl_chat" / "config.json"
IMG, IMG_END, IMG_PAD = 151857, 151858, 151859
SEQ_LENGTH = 64  # the tiny checkpoint's: NTK and logn act past 64 tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "tiny-qwen-vl"
    assert cli_main(["make-tiny", str(out), "--arch", "qwen_vl"]) == 0
    return out


@pytest.fixture(scope="module")
def harness(ckpt: Path) -> Harness:
    return Harness(ckpt, torch.float32)


@pytest.fixture(scope="module")
def reference_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return {name: t.float() for name, t in load_file(str(ckpt / "model.safetensors")).items()}


def image_item(offset: int, seed: int) -> MultiModalItem:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(3, 448, 448, generator=g)
    return MultiModalItem("image", offset, 256, (1, 32, 32), f"img{seed}", pixels, (448, 448), (448, 448))


def image_prompt_ids(url: bytes = b"demo.jpeg") -> tuple[list[int], int]:
    """'Picture 1: <img>URL</img>\\n...' as token ids: the URL's bytes (byte tokens' ids are not
    needed here: any ids) padded with <imgpad> to 256 between <img> and </img>."""
    span = [1000 + b for b in url] + [IMG_PAD] * (256 - len(url))
    ids = [151644, 8948, 198, *range(300, 317), 151645, 198, 151644, 872, 198, IMG, *span, IMG_END, 198]
    ids += [*range(500, 510), 151645, 198, 151644, 77091, 198]
    return ids, ids.index(IMG) + 1


# -- a dense transcription of the reference ------------------------------------------


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def get_abs_pos(abs_pos: torch.Tensor, tgt_size: int) -> torch.Tensor:
    src, tgt = int(math.sqrt(abs_pos.size(0))), int(math.sqrt(tgt_size))
    if src == tgt:
        return abs_pos
    grid = abs_pos.float().reshape(1, src, src, -1).permute(0, 3, 1, 2)
    out = F.interpolate(grid, size=(tgt, tgt), mode="bicubic", align_corners=False)
    return out.permute(0, 2, 3, 1).flatten(0, 2)


def dense_visual(sd: dict[str, torch.Tensor], images: torch.Tensor, heads: int) -> torch.Tensor:
    """VisionTransformer.forward as the seed lays it out; the Resampler through torch's own
    nn.MultiheadAttention. images [B, 3, 448, 448] -> [B, 256, output_dim]."""
    v = "transformer.visual."
    x = F.conv2d(images, sd[v + "conv1.weight"], stride=14)  # [B, width, 32, 32]
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)
    x = x + get_abs_pos(sd[v + "positional_embedding"], x.size(1))
    width = x.shape[-1]
    x = F.layer_norm(x, (width,), sd[v + "ln_pre.weight"], sd[v + "ln_pre.bias"], 1e-6).permute(1, 0, 2)
    sq, b, _ = x.shape
    hn = width // heads
    i = 0
    while f"{v}transformer.resblocks.{i}.ln_1.weight" in sd:
        p = f"{v}transformer.resblocks.{i}."
        y = F.layer_norm(x, (width,), sd[p + "ln_1.weight"], sd[p + "ln_1.bias"], 1e-6)
        mixed = F.linear(y, sd[p + "attn.in_proj.weight"], sd[p + "attn.in_proj.bias"]).view(sq, b, heads, 3 * hn)
        q, k, val = mixed.split(hn, dim=-1)  # VisualAttention: per head [q | k | v]
        q = q.reshape(sq, b * heads, hn).transpose(0, 1) / math.sqrt(hn)
        k = k.reshape(sq, b * heads, hn).transpose(0, 1)
        val = val.reshape(sq, b * heads, hn).transpose(0, 1)
        ctx = torch.bmm(torch.bmm(q, k.transpose(-2, -1)).softmax(-1), val)
        ctx = ctx.view(b, heads, sq, hn).permute(2, 0, 1, 3).reshape(sq, b, width)
        x = x + F.linear(ctx, sd[p + "attn.out_proj.weight"], sd[p + "attn.out_proj.bias"])
        y = F.layer_norm(x, (width,), sd[p + "ln_2.weight"], sd[p + "ln_2.bias"], 1e-6)
        y = F.gelu(F.linear(y, sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"]))
        x = x + F.linear(y, sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"])
        i += 1
    x = x.permute(1, 0, 2)  # [B, 1024, width]
    a = v + "attn_pool."
    dim = sd[a + "query"].shape[1]
    mha = nn.MultiheadAttention(dim, dim // 128)
    mha.load_state_dict(
        {
            "in_proj_weight": sd[a + "attn.in_proj_weight"],
            "in_proj_bias": sd[a + "attn.in_proj_bias"],
            "out_proj.weight": sd[a + "attn.out_proj.weight"],
            "out_proj.bias": sd[a + "attn.out_proj.bias"],
        }
    )
    pos_embed = sd[a + "pos_embed"]
    kv = F.linear(x, sd[a + "kv_proj.weight"])
    kv = F.layer_norm(kv, (dim,), sd[a + "ln_kv.weight"], sd[a + "ln_kv.bias"], 1e-6).permute(1, 0, 2)
    q = F.layer_norm(sd[a + "query"], (dim,), sd[a + "ln_q.weight"], sd[a + "ln_q.bias"], 1e-6)
    with torch.no_grad():
        out = mha(
            q.unsqueeze(1).repeat(1, b, 1) + pos_embed.unsqueeze(1),
            kv + get_abs_pos(pos_embed, kv.shape[0]).unsqueeze(1),
            kv,
        )[0].permute(1, 0, 2)
    out = F.layer_norm(out, (dim,), sd[v + "ln_post.weight"], sd[v + "ln_post.bias"], 1e-6)
    return out @ sd[v + "proj"]


class DenseReference:
    """QWenLMHeadModel.forward for one sequence, with a past_key_values cache of rotated keys.
    decode_alpha "cached": decode steps reuse the prefill's ntk_alpha (the reference's code: the rule
    runs only when kv_seq_len == the forward's length); "per_step": each forward picks it from its
    own kv_seq_len (the rule the engine gets when decode tokens' row 1 is their position)."""

    def __init__(self, sd: dict[str, torch.Tensor], config: dict, decode_alpha: str = "cached") -> None:
        self.sd, self.config, self.decode_alpha = sd, config, decode_alpha
        self.seq_length = config["seq_length"]
        self.heads = config["num_attention_heads"]
        self.hidden = config["hidden_size"]
        self.head_dim = self.hidden // self.heads
        self.past: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ntk_alpha_cached = 1.0
        self.logn = [math.log(i, self.seq_length) if i > self.seq_length else 1 for i in range(1, 32768)]

    def rotary(self, kv_seq_len: int, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
        dim = self.head_dim
        base = self.config["rotary_emb_base"] * alpha ** (dim / (dim - 2))
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        freqs = torch.outer(torch.arange(max(2 * kv_seq_len, 16)).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:kv_seq_len], emb.sin()[:kv_seq_len]

    @staticmethod
    def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x0, x1 = x.split(x.shape[-1] // 2, dim=-1)  # q_i pairs with q_{i + d/2}
        return x * cos[:, None] + torch.cat([-x1, x0], dim=-1) * sin[:, None]

    def __call__(self, embeds: torch.Tensor) -> torch.Tensor:
        sd, n = self.sd, embeds.shape[0]
        past_len = self.past[0][0].shape[0] if self.past else 0
        kv_seq_len = past_len + n
        if kv_seq_len == n or self.decode_alpha == "per_step":
            context_value = math.log(kv_seq_len / self.seq_length, 2) + 1
            alpha = max(2 ** math.ceil(context_value) - 1, 1)
        else:
            alpha = self.ntk_alpha_cached
        self.ntk_alpha_cached = alpha
        cos, sin = self.rotary(kv_seq_len, alpha)
        cos, sin = cos[-n:], sin[-n:]
        logn = torch.tensor(self.logn[past_len:kv_seq_len])[:, None, None]
        mask = torch.arange(kv_seq_len)[None, :] <= torch.arange(past_len, kv_seq_len)[:, None]
        h = embeds
        present = []
        for i in range(self.config["num_hidden_layers"]):
            p = f"transformer.h.{i}."
            x = rms_norm(h, sd[p + "ln_1.weight"])
            q, k, v = F.linear(x, sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"]).split(self.hidden, -1)
            q, k, v = (t.view(n, self.heads, self.head_dim) for t in (q, k, v))
            q, k = self.apply_rotary(q, cos, sin), self.apply_rotary(k, cos, sin)
            if self.past:
                k, v = torch.cat((self.past[i][0], k)), torch.cat((self.past[i][1], v))
            present.append((k, v))
            q = q * logn
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim)
            probs = scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-1)
            out = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, self.hidden)
            h = h + F.linear(out, sd[p + "attn.c_proj.weight"])
            x = rms_norm(h, sd[p + "ln_2.weight"])
            a1, a2 = F.linear(x, sd[p + "mlp.w1.weight"]), F.linear(x, sd[p + "mlp.w2.weight"])
            h = h + F.linear(a1 * F.silu(a2), sd[p + "mlp.c_proj.weight"])
        self.past = present
        return F.linear(rms_norm(h, sd["transformer.ln_f.weight"]), sd["lm_head.weight"])

    def prompt_embeds(self, ids: list[int], images: torch.Tensor | None = None) -> torch.Tensor:
        """wte(ids), then hidden_states[a + 1 : b] = images[k] for the k-th <img> at a, </img> at b."""
        h = F.embedding(torch.tensor(ids), self.sd["transformer.wte.weight"])
        if images is not None:
            visual = dense_visual(self.sd, images, self.config["visual"]["heads"])
            starts = [i for i, t in enumerate(ids) if t == IMG]
            ends = [i for i, t in enumerate(ids) if t == IMG_END]
            for k, (a, b) in enumerate(zip(starts, ends, strict=True)):
                h[a + 1 : b] = visual[k]
        return h


# -- our model driven through paged attention --------------------------------------------------


def paged_logits(h: Harness, embeds: torch.Tensor, positions: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Logits of every token, computed in steps of `sizes` tokens over one paged sequence."""
    total = embeds.shape[0]
    assert sum(sizes) == total
    assert h.kv.allocate_slots("r", total)
    out, start = [], 0
    try:
        for n in sizes:
            end = start + n
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([h.kv.slot("r", t) for t in range(start, end)]),
                block_tables=torch.tensor([h.kv.block_ids["r"]]),
                seq_lens=torch.tensor([end]),
                query_start_loc=[0, n],
                seq_lens_host=[end],
                block_size=h.kv.block_size,
            )
            with torch.inference_mode():
                hidden = h.model(None, positions[:, start:end], meta, embeds[start:end])
                out.append(h.model.compute_logits(hidden).float())
            start = end
    finally:
        h.kv.free("r")
    return torch.cat(out)


def positions_for(num_prompt: int, num_decoded: int, decode_alpha: str) -> torch.Tensor:
    """[3, N]: row 0 the position; row 1 + 1 the length NTK uses: the prompt's for prompt tokens
    and, with "cached", for decoded ones too (the reference's rule); with "per_step" decoded token i has i + 1."""
    total = num_prompt + num_decoded
    rows = torch.arange(total).expand(3, -1).clone()
    rows[1, :num_prompt] = num_prompt - 1
    if decode_alpha == "cached":
        rows[1, num_prompt:] = num_prompt - 1
    return rows


@pytest.fixture(scope="module")
def raw_config(ckpt: Path) -> dict:
    return json.loads((ckpt / "config.json").read_text())


# -- stages ---------------------------------------------------------------------------------------


def test_published_config_parses() -> None:
    config = load_model_config(FIXTURE)
    assert config.architecture == "QWenLMHeadModel" and config.model_type == "qwen"
    text, qwen = config.text, qwen_vl_config(config)
    assert qwen is not None
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads) == (4096, 32, 32)
    assert (text.num_key_value_heads, text.head_dim, text.intermediate_size) == (32, 128, 11008)
    assert (text.rope_theta, text.rms_norm_eps, text.vocab_size) == (10000.0, 1e-6, 151936)
    assert text.tie_word_embeddings is False and text.mrope_section is None
    assert (qwen.seq_length, qwen.use_dynamic_ntk, qwen.use_logn_attn, qwen.rotary_dim) == (2048, True, True, 128)
    v = qwen.visual
    assert (v.grid_size, v.num_patches, v.mlp_width, v.resampler_heads, v.n_queries) == (32, 1024, 8192, 32, 256)
    assert (config.image_token_id, config.vision_start_token_id, config.vision_end_token_id) == (IMG, IMG, IMG_END)
    assert (config.vision.depth, config.vision.embed_dim, config.vision.hidden_size) == (48, 1664, 4096)
    assert config.checkpoint_dtype == torch.bfloat16


def test_bad_qwen_configs_say_what_is_wrong() -> None:
    raw = json.loads(FIXTURE.read_text())
    with pytest.raises(ValueError, match="kv_channels 64 x num_attention_heads 32"):
        parse_model_config({**raw, "kv_channels": 64})
    with pytest.raises(ValueError, match="output_dim 64 must be at least 128"):
        small = {"hidden_size": 64, "num_attention_heads": 4, "kv_channels": 16}
        parse_model_config({**raw, **small, "visual": {**raw["visual"], "output_dim": 64}})
    with pytest.raises(ValueError, match="'visual' dict"):
        parse_model_config({k: x for k, x in raw.items() if k != "visual"})


def test_rotary_pairs_dimension_i_with_i_plus_half() -> None:
    """Each pair (i, i + d/2) turns by position * theta_i, theta_i = base**(-2i / d): a 2-D rotation."""
    d, base, m = 16, 10000.0, 37
    rotary = QwenRotaryEmbedding(d, base, seq_length=2048, use_dynamic_ntk=True)
    cos, sin = rotary(torch.tensor([m]), torch.tensor([m + 1]))
    x = torch.randn(1, 2, d)
    y = apply_qwen_rotary(x, cos, sin)
    for i in range(d // 2):
        angle = m * base ** (-2 * i / d)
        a, b = x[0, :, i].double(), x[0, :, i + d // 2].double()
        expect_a = a * math.cos(angle) - b * math.sin(angle)
        expect_b = a * math.sin(angle) + b * math.cos(angle)
        torch.testing.assert_close(y[0, :, i].double(), expect_a, atol=1e-5, rtol=0)
        torch.testing.assert_close(y[0, :, i + d // 2].double(), expect_b, atol=1e-5, rtol=0)
    # rotary_pct < 1: only the first rotary_dim dimensions turn.
    x = torch.randn(1, 2, 2 * d)
    y = apply_qwen_rotary(x, cos, sin)
    assert torch.equal(y[..., d:], x[..., d:])
    torch.testing.assert_close(y[..., :d], apply_qwen_rotary(x[..., :d].contiguous(), cos, sin))


@pytest.mark.parametrize("seq_length", [2048, SEQ_LENGTH])
def test_ntk_alpha_changes_exactly_at_the_seeds_thresholds(seq_length: int) -> None:
    # The reference's examples: up to 2048 -> 1; 4096 (two times) -> 3; then 7 up to four times.
    assert [ntk_alpha(n, 2048) for n in (1, 2047, 2048, 2049, 4096, 4097, 8192, 8193)] == [1, 1, 1, 3, 3, 7, 7, 15]
    rotary = QwenRotaryEmbedding(128, 10000.0, seq_length, use_dynamic_ntk=True)
    lengths = torch.arange(1, 20 * seq_length)
    doublings = rotary.doublings(lengths)
    alphas = [ntk_alpha(int(n), seq_length) for n in lengths]
    assert [2 ** (int(k) + 1) - 1 for k in doublings] == alphas
    # The base grows as base * alpha ** (d / (d - 2)).
    for k in (0, 1, 2, 4):
        alpha = 2 ** (k + 1) - 1
        inv_freq = 1.0 / ((10000.0 * alpha ** (128 / 126)) ** (torch.arange(0, 128, 2).float() / 128))
        assert torch.equal(rotary.inv_freq[k], inv_freq)
    fixed = QwenRotaryEmbedding(128, 10000.0, seq_length, use_dynamic_ntk=False)
    assert fixed.doublings(lengths).max() == 0


def test_logn_factors() -> None:
    factors = logn_factors(SEQ_LENGTH, 300)
    assert torch.equal(factors[:SEQ_LENGTH], torch.ones(SEQ_LENGTH))  # positions 0..63: p + 1 <= 64
    p = torch.arange(SEQ_LENGTH, 300)
    torch.testing.assert_close(factors[SEQ_LENGTH:], torch.log(p + 1.0) / math.log(SEQ_LENGTH))
    assert factors[SEQ_LENGTH] > 1


def test_positional_tables(reference_weights: dict[str, torch.Tensor]) -> None:
    """The Resampler's queries carry a 16 x 16 2-D sin-cos table (first half x, second half y,
    each [sin | cos]); at 448 px both 256-row tables are resized to 32 x 32 = 1024 patches, at
    224 px they are used as they are."""
    table = reference_weights["transformer.visual.attn_pool.pos_embed"]
    dim = table.shape[1]
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    for row in (0, 1, 17, 255):
        y, x = divmod(row, 16)
        expect = torch.cat([(x * omega).sin(), (x * omega).cos(), (y * omega).sin(), (y * omega).cos()])
        torch.testing.assert_close(table[row].double(), expect, atol=1e-2, rtol=0)  # stored in bfloat16
    assert resize_pos_embed(table, 1024).shape == (1024, dim)
    assert resize_pos_embed(table, 256) is table


def test_visual_output_shape_and_every_patch_counts(harness: Harness) -> None:
    visual = harness.model.transformer.visual
    images = torch.stack([image_item(0, 1).pixel_values, image_item(0, 2).pixel_values])
    with torch.inference_mode():
        base = visual(images)
        assert base.shape == (2, 256, 256)  # [B, n_queries, output_dim]
        for row, col in [(0, 0), (15, 20), (31, 31)]:  # one 14 x 14 patch of image 0
            changed = images.clone()
            changed[0, :, 14 * row : 14 * row + 14, 14 * col : 14 * col + 14] += 1.0
            out = visual(changed)
            assert ((out[0] - base[0]).abs().amax(-1) > 1e-6).all()  # every query moved
            assert torch.equal(out[1], base[1])  # the other image did not
        # The Resampler alone: each query attends to every one of the 1024 patch features.
        pool = visual.attn_pool
        x = torch.randn(1, 1024, visual.config.width)
        ref = pool(x)
        for j in (0, 511, 1023):
            x2 = x.clone()
            x2[0, j] += 1.0
            assert ((pool(x2) - ref).abs().amax(-1) > 1e-7).all()


def test_visual_matches_dense_reference(harness: Harness, reference_weights: dict[str, torch.Tensor]) -> None:
    items = [image_item(0, 3), image_item(300, 4)]
    with torch.inference_mode():
        ours = harness.model.embed_multimodal(items)
    reference = dense_visual(reference_weights, torch.stack([i.pixel_values for i in items]), heads=2)
    assert [t.shape for t in ours] == [(256, 256)] * 2
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_image_embeddings_land_in_their_span(harness: Harness) -> None:
    """Through the engine's ModelRunner: the 256 positions after <img> hold the image's
    embeddings; <img>, </img> and the text keep their token embeddings."""
    ids, offset = image_prompt_ids()
    item = image_item(offset, 5)
    prompt = ProcessedPrompt(ids, [item], positions_for(len(ids), 0, "cached"), 0)
    model = harness.model
    kv = KVCacheManager(64, block_size=16)
    runner = ModelRunner(model, torch.device("cpu"), torch.float32)
    runner.bind_kv_cache(kv.pool.num_blocks, kv.block_size)
    assert kv.allocate_slots("r", len(ids))
    new = NewRequestData(
        request_id="r",
        prompt_token_ids=ids,
        mm_items=[item],
        mrope_positions=prompt.mrope_positions,
        mrope_delta=0,
        sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
        block_ids=kv.block_ids["r"],
        num_computed_tokens=0,
    )
    seen: list[torch.Tensor] = []
    hook = model.transformer.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    try:
        runner.execute(
            SchedulerOutput(
                scheduled_new_reqs=[new], num_scheduled_tokens={"r": len(ids)}, scheduled_encoder_inputs={"r": [0]}
            )
        )
    finally:
        hook.remove()
    with torch.inference_mode():
        image = model.embed_multimodal([item])[0]
        text = model.get_input_embeddings(torch.tensor(ids))
    (embeds,) = seen
    assert torch.equal(embeds[offset : offset + 256], image)
    span = torch.zeros(len(ids), dtype=torch.bool)
    span[offset : offset + 256] = True
    assert torch.equal(embeds[~span], text[~span])
    assert ids[offset - 1] == IMG and ids[offset + 256] == IMG_END


# -- the whole model ----------------------------------------------------------------------------


def test_prompt_with_image_and_decode_match_dense_reference(
    harness: Harness, reference_weights: dict[str, torch.Tensor], raw_config: dict
) -> None:
    """A 285-token prompt (ntk_alpha 15 for seq_length 64, logn on every query past 64) computed
    in two chunks, the first ending inside the image span, then three decode steps."""
    ids, offset = image_prompt_ids()
    extra = [1234, 77, 151645]
    item = image_item(offset, 6)
    assert ntk_alpha(len(ids), SEQ_LENGTH) == 15
    ref = DenseReference(reference_weights, raw_config, "cached")
    embeds = ref.prompt_embeds(ids, item.pixel_values[None])
    wte = reference_weights["transformer.wte.weight"]
    expected_logits = torch.cat([ref(embeds)] + [ref(F.embedding(torch.tensor([t]), wte)) for t in extra])

    with torch.inference_mode():
        ours_embeds = harness.model.get_input_embeddings(torch.tensor(ids + extra))
        ours_embeds[offset : offset + 256] = harness.model.embed_multimodal([item])[0]
    positions = positions_for(len(ids), len(extra), "cached")
    chunks = [offset + 100, len(ids) - offset - 100, 1, 1, 1]
    ours = paged_logits(harness, ours_embeds, positions, chunks)
    assert ours.shape == expected_logits.shape
    torch.testing.assert_close(ours, expected_logits, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("decode_alpha", ["cached", "per_step"])
def test_decoding_past_seq_length_matches_the_reference_rule(
    harness: Harness, reference_weights: dict[str, torch.Tensor], raw_config: dict, decode_alpha: str
) -> None:
    """A 60-token text prompt, then 10 decoded tokens across seq_length 64: logn starts at
    position 64; with "per_step" the tokens from position 64 (length 65) on rotate with alpha 3 while the
    cached keys keep alpha 1. Our paged engine equals the reference's KV-cache loop either way;
    which one it follows is decided by positions row 1 alone."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 151000, (70,), generator=g).tolist()
    num_prompt = 60
    ref = DenseReference(reference_weights, raw_config, decode_alpha)
    wte = reference_weights["transformer.wte.weight"]
    expected = [ref(F.embedding(torch.tensor(ids[:num_prompt]), wte))]
    expected += [ref(F.embedding(torch.tensor([t]), wte)) for t in ids[num_prompt:]]
    with torch.inference_mode():
        embeds = harness.model.get_input_embeddings(torch.tensor(ids))
    positions = positions_for(num_prompt, 10, decode_alpha)
    ours = paged_logits(harness, embeds, positions, [num_prompt] + [1] * 10)
    torch.testing.assert_close(ours, torch.cat(expected), atol=2e-4, rtol=1e-4)
    if decode_alpha == "per_step":  # the rules differ once decoding passes seq_length
        other = paged_logits(harness, embeds, positions_for(num_prompt, 10, "cached"), [num_prompt] + [1] * 10)
        assert torch.equal(other[:64], ours[:64])  # token 64 is the first computed at length 65
        assert (other[64:] - ours[64:]).abs().amin(-1).gt(0).all()


def test_bfloat16_runs_close_to_float32(ckpt: Path, harness: Harness) -> None:
    ids, offset = image_prompt_ids()
    item = image_item(offset, 8)
    positions = positions_for(len(ids), 0, "cached")
    results = []
    for h in (harness, Harness(ckpt, torch.bfloat16)):
        with torch.inference_mode():
            embeds = h.model.get_input_embeddings(torch.tensor(ids))
            embeds[offset : offset + 256] = h.model.embed_multimodal([item])[0].to(embeds.dtype)
        results.append(paged_logits(h, embeds, positions, [len(ids)])[-1])
    full, half = results
    assert (half - full).abs().mean() < 0.05 * full.abs().mean()


# -- weights --------------------------------------------------------------------------------------


def published_names(layers: int, vision_layers: int) -> set[str]:
    names = {"transformer.wte.weight", "transformer.ln_f.weight", "lm_head.weight"}
    for i in range(layers):
        p = f"transformer.h.{i}."
        names |= {p + s for s in ("ln_1.weight", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight")}
        names |= {p + s for s in ("ln_2.weight", "mlp.w1.weight", "mlp.w2.weight", "mlp.c_proj.weight")}
    v = "transformer.visual."
    names |= {v + s for s in ("conv1.weight", "positional_embedding", "ln_pre.weight", "ln_pre.bias", "proj")}
    names |= {v + s for s in ("ln_post.weight", "ln_post.bias")}
    for i in range(vision_layers):
        p = f"{v}transformer.resblocks.{i}."
        for module in ("ln_1", "ln_2", "attn.in_proj", "attn.out_proj", "mlp.c_fc", "mlp.c_proj"):
            names |= {f"{p}{module}.weight", f"{p}{module}.bias"}
    a = v + "attn_pool."
    names |= {a + s for s in ("query", "pos_embed", "kv_proj.weight", "attn.in_proj_weight", "attn.in_proj_bias")}
    names |= {a + s for s in ("attn.out_proj.weight", "attn.out_proj.bias", "ln_q.weight", "ln_q.bias")}
    names |= {a + s for s in ("ln_kv.weight", "ln_kv.bias")}
    return names


def test_weights_load_from_published_names(ckpt: Path, harness: Harness, tmp_path: Path) -> None:
    weights = load_file(str(ckpt / "model.safetensors"))
    assert set(weights) == published_names(2, 2)
    assert set(dict(harness.model.named_parameters())) == set(weights)
    assert weights["transformer.visual.conv1.weight"].shape == (32, 3, 14, 14)  # the Conv2d kernel as published

    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    del weights["transformer.h.1.mlp.w2.weight"]
    weights["transformer.visual.extra.weight"] = torch.zeros(1)
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="transformer.visual.extra.weight"):
        Harness(broken)
    del weights["transformer.visual.extra.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks weights: \['transformer.h.1.mlp.w2.weight'\]"):
        Harness(broken)


def test_make_tiny_writes_the_published_layout(ckpt: Path) -> None:
    names = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer_config.json", "qwen.tiktoken"} <= names
    assert "model.safetensors" in names
    config = json.loads((ckpt / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_qwen.QWenLMHeadModel"
    assert config["visual"]["image_size"] == 448 and config["seq_length"] == SEQ_LENGTH
    generation = json.loads((ckpt / "generation_config.json").read_text())
    assert generation["chat_format"] == "chatml" and generation["max_window_size"] == 6144
    assert generation["eos_token_id"] == generation["pad_token_id"] == 151643
    tokenizer = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert tokenizer["auto_map"]["AutoTokenizer"][0] == "tokenization_qwen.QWenTokenizer"
    assert len((ckpt / "qwen.tiktoken").read_bytes().splitlines()) == 151643
