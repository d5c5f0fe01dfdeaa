"""Write tiny random-weight Qwen3-VL and Qwen3-VL-MoE checkpoints in the published Hugging Face
layout: nested config.json (text_config with rope_parameters holding mrope_section and
mrope_interleaved, vision_config with deepstack_visual_indexes), generation_config.json,
preprocessor_config.json and video_preprocessor_config.json (16-pixel patches, mean and std 0.5),
the real Qwen vocabulary with Qwen3-VL's added tokens, the published chat template, and
safetensors weights under the published names (MoE experts fused as experts.gate_up_proj
[expert, hidden, 2 * moe_intermediate] and experts.down_proj [expert, moe_intermediate, hidden])."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from vlmserve.families.common.tiny import (
    QWEN3_VL_BLOCK,
    RandomWeights,
    added_tokens_decoder,
    decoder_norm_weights,
    in_dtype,
    layer_norm_vision_block,
    qwen3_attention_weights,
    swiglu_weights,
    tiny_info,
    write_checkpoint,
)
from vlmserve.families.qwen3_vl.tiny_retrieval import sentence_transformers_files
from vlmserve.model_files import VOCAB_SIZE, save_weights
from vlmserve.tools.tiktoken_to_hf import write_tokenizer_files

# The chat template Qwen3-VL-*-Instruct publish (chat_template.json): no default system prompt;
# tools in a <tools> block; images and videos as <|vision_start|><|image_pad|>/<|video_pad|><|vision_end|>.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0].role == 'system' %}\n"
    "        {%- if messages[0].content is string %}\n            {{- messages[0].content }}\n"
    "        {%- else %}\n            {%- for content in messages[0].content %}\n"
    "                {%- if 'text' in content %}\n                    {{- content.text }}\n"
    "                {%- endif %}\n            {%- endfor %}\n        {%- endif %}\n        {{- '\\n\\n' }}\n"
    "    {%- endif %}\n"
    '    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided '
    'with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n    {%- if messages[0].role == 'system' %}\n        {{- '<|im_start|>system\\n' }}\n"
    "        {%- if messages[0].content is string %}\n            {{- messages[0].content }}\n"
    "        {%- else %}\n            {%- for content in messages[0].content %}\n"
    "                {%- if 'text' in content %}\n                    {{- content.text }}\n"
    "                {%- endif %}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n"
    "{%- set image_count = namespace(value=0) %}\n{%- set video_count = namespace(value=0) %}\n"
    '{%- for message in messages %}\n    {%- if message.role == "user" %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' }}\n        {%- if message.content is string %}\n"
    "            {{- message.content }}\n        {%- else %}\n            {%- for content in message.content %}\n"
    "                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}\n"
    "                    {%- set image_count.value = image_count.value + 1 %}\n"
    "                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}\n"
    "                    <|vision_start|><|image_pad|><|vision_end|>\n"
    "                {%- elif content.type == 'video' or 'video' in content %}\n"
    "                    {%- set video_count.value = video_count.value + 1 %}\n"
    "                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}\n"
    "                    <|vision_start|><|video_pad|><|vision_end|>\n"
    "                {%- elif 'text' in content %}\n                    {{- content.text }}\n"
    "                {%- endif %}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' }}\n        {%- if message.content is string %}\n"
    "            {{- message.content }}\n        {%- else %}\n            {%- for content_item in message.content %}\n"
    "                {%- if 'text' in content_item %}\n                    {{- content_item.text }}\n"
    "                {%- endif %}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and message.content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n                {%- endif %}\n"
    "                {%- if tool_call.function %}\n                    {%- set tool_call = tool_call.function %}\n"
    '                {%- endif %}\n                {{- \'<tool_call>\\n{"name": "\' }}\n'
    '                {{- tool_call.name }}\n                {{- \'", "arguments": \' }}\n'
    "                {%- if tool_call.arguments is string %}\n                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n                {{- '}\\n</tool_call>' }}\n            {%- endfor %}\n"
    "        {%- endif %}\n        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n"
    '        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {%- if message.content is string %}\n            {{- message.content }}\n        {%- else %}\n"
    "            {%- for content in message.content %}\n"
    "                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}\n"
    "                    {%- set image_count.value = image_count.value + 1 %}\n"
    "                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}\n"
    "                    <|vision_start|><|image_pad|><|vision_end|>\n"
    "                {%- elif content.type == 'video' or 'video' in content %}\n"
    "                    {%- set video_count.value = video_count.value + 1 %}\n"
    "                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}\n"
    "                    <|vision_start|><|video_pad|><|vision_end|>\n"
    "                {%- elif 'text' in content %}\n                    {{- content.text }}\n"
    "                {%- endif %}\n            {%- endfor %}\n        {%- endif %}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)

# Ids 151643.. as in the published Qwen3-VL tokenizer: (content, special).
QWEN3_VL_ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
FIRST_ADDED_ID = 151643

ARCHES = ("qwen3_vl", "qwen3_vl_moe")
TASKS = ("generate", "embedding", "reranker")
_ARCHITECTURE = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}


@dataclass(frozen=True)
class TinySpec:
    arch: str = "qwen3_vl"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    # Sums to head_dim / 2; interleaved: t h w t h w t t (section-wise it would be t t t t h h w w).
    mrope_section: tuple[int, int, int] = (4, 2, 2)
    vision_depth: int = 3
    vision_hidden_size: int = 32
    vision_num_heads: int = 2
    vision_intermediate_size: int = 64
    # Features after blocks 0 and 1 go to decoder layers 0 and 1; the merger reads block 2.
    deepstack_visual_indexes: tuple[int, ...] = (0, 1)
    # An 8 x 8 learned grid: every image of more than 8 patches a side is interpolated.
    num_position_embeddings: int = 64
    tie_word_embeddings: bool = True
    dtype: str = "bfloat16"
    # What the checkpoint is published for: "generate" (the Instruct checkpoints), "embedding"
    # (Qwen3-VL-Embedding: no lm_head.weight at all, tied or not, and sentence-transformers' files)
    # or "reranker" (Qwen3-VL-Reranker: a generation checkpoint whose lm_head rows of "yes" and "no"
    # score a pair).
    task: str = "generate"
    # MoE (arch "qwen3_vl_moe"): 2 * moe_intermediate_size differs from hidden_size, so an expert
    # matrix loaded the wrong way round fails on its shape.
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 24
    mlp_only_layers: tuple[int, ...] = (1,)


MOE_SPEC = TinySpec(arch="qwen3_vl_moe", tie_word_embeddings=False)
# The benchmark checkpoint: Qwen3-VL-2B's language-model width (hidden 2048, MLP 6144, 16 query /
# 8 KV heads of 128, the full vocabulary) with 4 of its 28 layers, and a narrow 4-block tower.
BENCH_SPEC = TinySpec(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    mrope_section=(24, 20, 20),
    vision_depth=4,
    vision_hidden_size=256,
    vision_num_heads=4,
    vision_intermediate_size=1024,
    deepstack_visual_indexes=(1, 2),
    num_position_embeddings=2304,
)
# The whole Qwen3-VL-2B-Instruct architecture (about 4.3 GB in bfloat16): all 28 decoder layers
# and the 24-block vision tower with DeepStack after blocks 5, 11 and 17.
QWEN3_VL_2B_SPEC = replace(
    BENCH_SPEC,
    num_hidden_layers=28,
    vision_depth=24,
    vision_hidden_size=1024,
    vision_num_heads=16,
    vision_intermediate_size=4096,
    deepstack_visual_indexes=(5, 11, 17),
)
# Qwen3-VL-Embedding-8B's layout: tie_word_embeddings false in config.json and still no
# lm_head.weight in its safetensors index, so a loader must not ask for one.
EMBEDDING_SPEC = TinySpec(tie_word_embeddings=False, task="embedding")
# Qwen3-VL-Reranker as its published script reads it: a generation checkpoint whose lm_head rows
# of "yes" and "no" make the score; untied, as Qwen3-VL-8B is, so that reading the embedding's
# rows instead gives another score.
RERANKER_SPEC = TinySpec(tie_word_embeddings=False, task="reranker")
# Qwen3-VL-Embedding-2B: the whole Qwen3-VL-2B architecture (tied embeddings, as the 2B's) in
# the embedding layout: no lm_head weight, use_cache false, sentence-transformers' files (2048-wide
# embeddings). And its benchmark cut: the same widths with the bench preset's 4 decoder layers and
# narrow tower, for a measurement that fits in minutes on a few CPU cores.
EMBEDDING_2B_SPEC = replace(QWEN3_VL_2B_SPEC, task="embedding")
EMBEDDING_BENCH_SPEC = replace(BENCH_SPEC, task="embedding")
PRESETS = {
    ("qwen3_vl", "tiny"): TinySpec(),
    ("qwen3_vl", "bench"): BENCH_SPEC,
    ("qwen3_vl", "2b"): QWEN3_VL_2B_SPEC,
    ("qwen3_vl", "embedding"): EMBEDDING_SPEC,
    ("qwen3_vl", "reranker"): RERANKER_SPEC,
    ("qwen3_vl", "embedding-2b"): EMBEDDING_2B_SPEC,
    ("qwen3_vl", "embedding-bench"): EMBEDDING_BENCH_SPEC,
    ("qwen3_vl_moe", "tiny"): MOE_SPEC,
}


def config_json(spec: TinySpec) -> dict[str, object]:
    if spec.arch not in ARCHES:
        raise ValueError(f"unknown arch {spec.arch!r}; choose one of {ARCHES}")
    if spec.task not in TASKS:
        raise ValueError(f"unknown task {spec.task!r}; choose one of {TASKS}")
    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_interleaved": True}
    text = text_config_json(spec, f"{spec.arch}_text", rope)
    if spec.arch == "qwen3_vl_moe":
        text |= {
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(spec.mlp_only_layers),
            "moe_intermediate_size": spec.moe_intermediate_size,
            "norm_topk_prob": True,
            "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.num_experts_per_tok,
        }
    vision = vision_config_json(spec, f"{spec.arch}_vision") | {
        "deepstack_visual_indexes": list(spec.deepstack_visual_indexes)
    }
    config: dict[str, object] = {
        "architectures": [_ARCHITECTURE[spec.arch]],
        "model_type": spec.arch,
        "dtype": spec.dtype,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "text_config": text,
        "vision_config": vision,
    }
    if spec.task == "embedding":
        config["use_cache"] = False  # as Qwen3-VL-Embedding's config.json has it
    return config


def text_config_json(spec: Any, model_type: str, rope: dict[str, object]) -> dict[str, object]:
    """The language model's section of config.json (Qwen3.5 adds its own fields to it), from a
    spec's sizes, its mrope_section and tie_word_embeddings; `rope` the other rope_parameters."""
    return {
        "model_type": model_type,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "dtype": spec.dtype,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": 262144,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {**rope, "mrope_section": list(spec.mrope_section)},
        "tie_word_embeddings": spec.tie_word_embeddings,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


def vision_config_json(spec: Any, model_type: str) -> dict[str, object]:
    """The vision tower's section of config.json (Qwen3.5 has the same tower, without DeepStack),
    from a spec's vision_* fields, num_position_embeddings and hidden_size."""
    return {
        "model_type": model_type,
        "depth": spec.vision_depth,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": spec.vision_hidden_size,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": spec.vision_intermediate_size,
        "num_heads": spec.vision_num_heads,
        "num_position_embeddings": spec.num_position_embeddings,
        "out_hidden_size": spec.hidden_size,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }


def random_weights(spec: TinySpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights under the published names. Scales keep activations near unit size so every part
    (the DeepStack features and the router included) visibly moves the output."""
    w = RandomWeights(seed)
    h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_key_value_heads * d
    lm = "model.language_model."
    weights: dict[str, torch.Tensor] = {lm + "embed_tokens.weight": w.embedding(VOCAB_SIZE, h)}
    for layer in range(spec.num_hidden_layers):
        p = f"{lm}layers.{layer}."
        weights |= qwen3_attention_weights(w, p + "self_attn.", h, q, kv, d, norm_mean=1.0)
        weights |= decoder_norm_weights(w, p, h, mean=1.0)
        if spec.arch == "qwen3_vl_moe" and layer not in spec.mlp_only_layers:
            e, mi = spec.num_experts, spec.moe_intermediate_size
            weights |= {
                p + "mlp.gate.weight": w.linear(e, h) * 4,  # routing far from uniform
                p + "mlp.experts.gate_up_proj": w.randn(e, h, 2 * mi) / h**0.5,
                p + "mlp.experts.down_proj": w.randn(e, mi, h) / mi**0.5,
            }
        else:
            weights |= swiglu_weights(w, p + "mlp.", h, i)
    weights[lm + "norm.weight"] = w.vec(h, 1.0, 0.1)
    if not spec.tie_word_embeddings and spec.task != "embedding":
        weights["lm_head.weight"] = w.embedding(VOCAB_SIZE, h)

    weights |= vision_weights(
        w,
        width=spec.vision_hidden_size,
        intermediate=spec.vision_intermediate_size,
        depth=spec.vision_depth,
        num_positions=spec.num_position_embeddings,
        out_hidden=h,
        num_deepstack=len(spec.deepstack_visual_indexes),
    )
    return in_dtype(weights, spec.dtype)


def vision_weights(
    w: RandomWeights,
    *,
    width: int,
    intermediate: int,
    depth: int,
    num_positions: int,
    out_hidden: int,
    num_deepstack: int,
) -> dict[str, torch.Tensor]:
    """The Qwen3-VL vision tower's weights under `model.visual.` (Qwen3.5 has the same tower,
    without DeepStack mergers), drawn from `w` in a fixed order."""
    e, vis = width, "model.visual."
    weights = {
        vis + "patch_embed.proj.weight": w.randn(e, 3, 2, 16, 16) / (3 * 2 * 16 * 16) ** 0.5,
        vis + "patch_embed.proj.bias": w.vec(e, std=0.1),
        vis + "pos_embed.weight": w.randn(num_positions, e),
    }
    for block in range(depth):
        weights |= layer_norm_vision_block(w, f"{vis}blocks.{block}.", e, intermediate, QWEN3_VL_BLOCK)
    merged = 4 * e
    for p in ["merger."] + [f"deepstack_merger_list.{k}." for k in range(num_deepstack)]:
        norm = e if p == "merger." else merged  # the DeepStack mergers normalise after the 2x2 concatenation
        weights |= {
            vis + p + "norm.weight": w.vec(norm, 1.0, 0.1),
            vis + p + "norm.bias": w.vec(norm),
            vis + p + "linear_fc1.weight": w.linear(merged, merged),
            vis + p + "linear_fc1.bias": w.vec(merged),
            vis + p + "linear_fc2.weight": w.linear(out_hidden, merged),
            vis + p + "linear_fc2.bias": w.vec(out_hidden),
        }
    return weights


def _tokenizer_config() -> dict[str, object]:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder(FIRST_ADDED_ID, QWEN3_VL_ADDED_TOKENS),
        "additional_special_tokens": [tok for tok, special in QWEN3_VL_ADDED_TOKENS[1:14]],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _preprocessor(kind: str, shortest: int, longest: int) -> dict[str, object]:
    return {
        "size": {"longest_edge": longest, "shortest_edge": shortest},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
        kind: "Qwen2VLImageProcessorFast" if kind == "image_processor_type" else "Qwen3VLVideoProcessor",
    }


def write_tiny_qwen3_vl(
    out_dir: str | Path, spec: TinySpec = TinySpec(), *, seed: int = 0, num_shards: int = 1
) -> Path:
    """Write the checkpoint into `out_dir` (created; written atomically)."""
    config = config_json(spec)
    extra = sentence_transformers_files(spec.hidden_size) if spec.task == "embedding" else {}
    return write_qwen3_vl_files(
        out_dir, config, random_weights(spec, seed), tiny_info(spec, seed), num_shards, extra=extra
    )


def write_qwen3_vl_files(
    out_dir: str | Path,
    config: dict[str, object],
    weights: dict[str, torch.Tensor],
    info: dict[str, object],
    num_shards: int = 1,
    chat_template: dict[str, object] | None = None,
    extra: dict[str, object] | None = None,
) -> Path:
    """A checkpoint of Qwen3-VL's files (tokenizer, chat template, processor configs) around the
    given config.json, weights and vlmserve_tiny.json, written atomically into `out_dir`;
    Qwen3.5's tiny writer uses it too, with its own `chat_template` (file name -> content);
    `extra` more files by relative path (the embedding checkpoints' sentence-transformers files)."""
    files: dict[str, object] = {
        "config.json": config,
        "generation_config.json": {
            "bos_token_id": 151643,
            "pad_token_id": 151643,
            "do_sample": True,
            "eos_token_id": [151645, 151643],
            "top_k": 20,
            "top_p": 0.8,
            "repetition_penalty": 1.0,
            "temperature": 0.7,
        },
        "preprocessor_config.json": _preprocessor("image_processor_type", 65536, 16777216),
        "video_preprocessor_config.json": _preprocessor("video_processor_type", 4096, 25165824),
        "tokenizer_config.json": _tokenizer_config(),
        "vlmserve_tiny.json": info,
    }
    files |= chat_template or {"chat_template.json": {"chat_template": QWEN3_VL_CHAT_TEMPLATE}}
    files |= extra or {}

    def write_rest(folder: Path) -> None:
        added = [(FIRST_ADDED_ID + k, tok, special) for k, (tok, special) in enumerate(QWEN3_VL_ADDED_TOKENS)]
        write_tokenizer_files(folder, added)
        save_weights(weights, folder, num_shards)

    return write_checkpoint(out_dir, files, write_rest)
