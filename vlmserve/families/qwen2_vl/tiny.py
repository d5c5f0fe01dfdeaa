"""Write tiny random-weight Qwen2-VL and Qwen2.5-VL checkpoints in the exact Hugging Face hub layout.

Real weights cannot be downloaded where vlmserve is developed and tested, so tests and the demo
run on these: config.json, generation_config.json, preprocessor_config.json, tokenizer.json (the
real Qwen vocabulary, converted from qwen.tiktoken), tokenizer_config.json with the published chat
template, and safetensors weights under the published names. Their answers are random text.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from vlmserve.families.common.tiny import (
    QWEN2_VL_BLOCK,
    RandomWeights,
    added_tokens_decoder,
    in_dtype,
    layer_norm_vision_block,
    tiny_info,
    write_checkpoint,
)
from vlmserve.model_files import VOCAB_SIZE, save_weights
from vlmserve.tools.tiktoken_to_hf import write_tokenizer_files

# The published Qwen2-VL-Instruct chat template (tokenizer_config.json / chat_template.json);
# Qwen2.5-VL-Instruct publish the same one.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The template Qwen2.5-VL-*-Instruct publish in tokenizer_config.json: the Qwen2.5 (text) one,
# with tools (hermes-style <tool_call> blocks, tool answers in <tool_response>), each message's
# content one string. Their chat_template.json holds QWEN2_VL_CHAT_TEMPLATE (no tools); vLLM
# renders a request with tools in this one.
QWEN2_5_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\'
    'n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    "\n"
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and'
    ' arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-nam'
    'e>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful"
    " assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (m'
    'essage.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }"
    "}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Ids 151643.. as in the published Qwen2-VL tokenizer; all of them are special tokens.
QWEN2_VL_ADDED_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
FIRST_ADDED_ID = 151643


@dataclass(frozen=True)
class TinySpec:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    mrope_section: tuple[int, int, int] = (2, 3, 3)  # sums to head_dim / 2 = 8
    vision_depth: int = 2
    vision_embed_dim: int = 32
    vision_num_heads: int = 2
    vision_mlp_ratio: int = 4
    tie_word_embeddings: bool = True
    dtype: str = "bfloat16"
    rope_theta: float = 1000000.0  # the decoder's M-RoPE base (Qwen2-VL's)
    # "qwen2_vl" or "qwen2_5_vl"; the fields below shape Qwen2.5-VL's vision tower only.
    arch: str = "qwen2_vl"
    vision_intermediate_size: int = 64  # the SwiGLU MLP's width
    # 112 px windows = 4 x 4 merged tokens (patch 14, merge 2); the listed blocks attend over whole frames.
    vision_window_size: int = 112
    vision_fullatt_block_indexes: tuple[int, ...] = (1,)
    tokens_per_second: int = 2


ARCHES = ("qwen2_vl", "qwen2_5_vl")


# The benchmark checkpoint: Qwen2-VL-2B's language-model width (hidden 1536, MLP 8960, 12 query /
# 2 KV heads, the full 151936-row vocabulary) with 4 of its 28 layers, and a narrow vision tower.
BENCH_SPEC = TinySpec(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=4,
    num_attention_heads=12,
    num_key_value_heads=2,
    mrope_section=(16, 24, 24),
    vision_depth=4,
    vision_embed_dim=320,
    vision_num_heads=5,
)

# A Qwen2.5-VL as small as TinySpec's, with four vision blocks (two windowed, two full-frame) so that
# window attention and the full-attention blocks both shape the output.
QWEN2_5_VL_SPEC = TinySpec(arch="qwen2_5_vl", vision_depth=4, vision_fullatt_block_indexes=(1, 3))
# BENCH_SPEC with Qwen2.5-VL's vision tower: the SwiGLU 3420 / 1280 times the tower's width.
QWEN2_5_VL_BENCH_SPEC = replace(
    BENCH_SPEC, arch="qwen2_5_vl", vision_intermediate_size=856, vision_fullatt_block_indexes=(1, 3)
)
# The whole Qwen2-VL-2B-Instruct architecture as published (28 layers, the 32-block 1280-wide vision
# tower, tied embeddings), random weights: what the GPU check (vlmserve.bench.gpu_check) measures.
QWEN2_VL_2B_SPEC = replace(
    BENCH_SPEC, num_hidden_layers=28, vision_depth=32, vision_embed_dim=1280, vision_num_heads=16
)
# (arch, preset) -> spec, for `vlmserve make-tiny --arch ... --preset ...`.
PRESETS = {
    ("qwen2_vl", "tiny"): TinySpec(),
    ("qwen2_vl", "bench"): BENCH_SPEC,
    ("qwen2_vl", "2b"): QWEN2_VL_2B_SPEC,
    ("qwen2_5_vl", "tiny"): QWEN2_5_VL_SPEC,
    ("qwen2_5_vl", "bench"): QWEN2_5_VL_BENCH_SPEC,
}


_ARCHITECTURE = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}


def _config(spec: TinySpec, nested: bool) -> dict[str, object]:
    text = {
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": 32768,
        "max_window_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "rms_norm_eps": 1e-06,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }
    if spec.arch not in ARCHES:
        raise ValueError(f"unknown arch {spec.arch!r}; choose one of {ARCHES}")
    vision: dict[str, object]
    if spec.arch == "qwen2_5_vl":
        # As Qwen2.5-VL-*-Instruct publish it: hidden_size is the tower's own width here.
        vision = {
            "depth": spec.vision_depth,
            "hidden_act": "silu",
            "hidden_size": spec.vision_embed_dim,
            "intermediate_size": spec.vision_intermediate_size,
            "num_heads": spec.vision_num_heads,
            "in_chans": 3,
            "out_hidden_size": spec.hidden_size,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": spec.vision_window_size,
            "fullatt_block_indexes": list(spec.vision_fullatt_block_indexes),
            "tokens_per_second": spec.tokens_per_second,
            "temporal_patch_size": 2,
        }
    else:
        vision = {
            "depth": spec.vision_depth,
            "embed_dim": spec.vision_embed_dim,
            "mlp_ratio": spec.vision_mlp_ratio,
            "num_heads": spec.vision_num_heads,
            "in_chans": 3,
            "hidden_size": spec.hidden_size,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
        }
    common = {
        "architectures": [_ARCHITECTURE[spec.arch]],
        "model_type": spec.arch,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "vision_token_id": 151654,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "vision_config": vision,
    }
    if nested:  # transformers 5's layout
        rope = {"rope_type": "default", "mrope_section": list(spec.mrope_section), "rope_theta": spec.rope_theta}
        return {**common, "dtype": spec.dtype, "text_config": {**text, "rope_parameters": rope}}
    # transformers 4.x's layout, as published on the hub
    return {
        **common,
        **text,
        "torch_dtype": spec.dtype,
        "rope_theta": spec.rope_theta,
        "rope_scaling": {"type": "mrope", "mrope_section": list(spec.mrope_section)},
    }


def random_weights(spec: TinySpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights under the published checkpoint names (scales as common/tiny.py's RandomWeights)."""
    w = RandomWeights(seed)
    h, i = spec.hidden_size, spec.intermediate_size
    head_dim = h // spec.num_attention_heads
    kv = spec.num_key_value_heads * head_dim
    weights: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w.embedding(VOCAB_SIZE, h)}
    for layer in range(spec.num_hidden_layers):
        p = f"model.layers.{layer}."
        weights |= {
            p + "self_attn.q_proj.weight": w.linear(h, h),
            p + "self_attn.q_proj.bias": w.vec(h, std=0.1),
            p + "self_attn.k_proj.weight": w.linear(kv, h),
            p + "self_attn.k_proj.bias": w.vec(kv, std=0.1),
            p + "self_attn.v_proj.weight": w.linear(kv, h),
            p + "self_attn.v_proj.bias": w.vec(kv, std=0.1),
            p + "self_attn.o_proj.weight": w.linear(h, h),
            p + "mlp.gate_proj.weight": w.linear(i, h),
            p + "mlp.up_proj.weight": w.linear(i, h),
            p + "mlp.down_proj.weight": w.linear(h, i),
            p + "input_layernorm.weight": w.vec(h, 1.0, 0.1),
            p + "post_attention_layernorm.weight": w.vec(h, 1.0, 0.1),
        }
    weights["model.norm.weight"] = w.vec(h, 1.0, 0.1)
    if not spec.tie_word_embeddings:
        weights["lm_head.weight"] = w.embedding(VOCAB_SIZE, h)

    e = spec.vision_embed_dim
    weights["visual.patch_embed.proj.weight"] = w.randn(e, 3, 2, 14, 14) / (3 * 2 * 14 * 14) ** 0.5
    if spec.arch == "qwen2_5_vl":
        weights |= _qwen2_5_vision_weights(spec, w)
    else:
        for block in range(spec.vision_depth):
            prefix = f"visual.blocks.{block}."
            weights |= layer_norm_vision_block(w, prefix, e, e * spec.vision_mlp_ratio, QWEN2_VL_BLOCK)
        weights |= {"visual.merger.ln_q.weight": w.vec(e, 1.0, 0.1), "visual.merger.ln_q.bias": w.vec(e)}
    weights |= {
        "visual.merger.mlp.0.weight": w.linear(4 * e, 4 * e),
        "visual.merger.mlp.0.bias": w.vec(4 * e),
        "visual.merger.mlp.2.weight": w.linear(h, 4 * e),
        "visual.merger.mlp.2.bias": w.vec(h),
    }
    return in_dtype(weights, spec.dtype)


def _qwen2_5_vision_weights(spec: TinySpec, w: RandomWeights) -> dict[str, torch.Tensor]:
    """Qwen2.5-VL's vision blocks and its merger's norm: RMSNorms (no bias), a SwiGLU MLP with biases."""
    e, mlp = spec.vision_embed_dim, spec.vision_intermediate_size
    weights: dict[str, torch.Tensor] = {}
    for block in range(spec.vision_depth):
        p = f"visual.blocks.{block}."
        weights |= {
            p + "norm1.weight": w.vec(e, 1.0, 0.1),
            p + "norm2.weight": w.vec(e, 1.0, 0.1),
            p + "attn.qkv.weight": w.linear(3 * e, e),
            p + "attn.qkv.bias": w.vec(3 * e, std=0.1),
            p + "attn.proj.weight": w.linear(e, e),
            p + "attn.proj.bias": w.vec(e),
            p + "mlp.gate_proj.weight": w.linear(mlp, e),
            p + "mlp.gate_proj.bias": w.vec(mlp),
            p + "mlp.up_proj.weight": w.linear(mlp, e),
            p + "mlp.up_proj.bias": w.vec(mlp),
            p + "mlp.down_proj.weight": w.linear(e, mlp),
            p + "mlp.down_proj.bias": w.vec(e),
        }
    weights["visual.merger.ln_q.weight"] = w.vec(e, 1.0, 0.1)
    return weights


def _tokenizer_config(template: str | None) -> dict[str, object]:
    config: dict[str, object] = {
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder(FIRST_ADDED_ID, [(tok, True) for tok in QWEN2_VL_ADDED_TOKENS]),
        "additional_special_tokens": QWEN2_VL_ADDED_TOKENS[1:],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if template is not None:
        config["chat_template"] = template
    return config


def write_tiny_qwen2_vl(
    out_dir: str | Path,
    spec: TinySpec = TinySpec(),
    *,
    seed: int = 0,
    nested_config: bool = False,
    num_shards: int = 1,
    chat_template_in: str | None = None,
    weights: dict[str, torch.Tensor] | None = None,
    preprocessor: dict[str, int] | None = None,
) -> Path:
    """Write a tiny Qwen2-VL checkpoint, or Qwen2.5-VL with spec.arch "qwen2_5_vl" (e.g.
    QWEN2_5_VL_SPEC), into `out_dir` (created; written atomically). The chat template goes where
    `chat_template_in` says; by default where the published checkpoints have it: Qwen2-VL's in
    tokenizer_config.json, Qwen2.5-VL's in chat_template.json with the Qwen2.5 template (tools)
    in tokenizer_config.json. `weights` (published names) replace the random ones, and then the
    folder carries no vlmserve_tiny.json; `preprocessor` overrides preprocessor_config.json fields
    (min_pixels, max_pixels)."""
    as_published = chat_template_in is None
    if chat_template_in is None:
        chat_template_in = "chat_template.json" if spec.arch == "qwen2_5_vl" else "tokenizer_config.json"
    if chat_template_in not in ("tokenizer_config.json", "chat_template.json", "chat_template.jinja"):
        raise ValueError(f"chat_template_in must name a file the template can live in, got {chat_template_in!r}")
    files: dict[str, object] = {
        "config.json": _config(spec, nested_config),
        "generation_config.json": {
            "bos_token_id": 151643,
            "pad_token_id": 151643,
            "do_sample": True,
            "eos_token_id": [151645, 151643],
            "repetition_penalty": 1.0,
            "temperature": 0.01,
            "top_p": 0.001,
            "top_k": 1,
        },
        "preprocessor_config.json": {
            "min_pixels": 3136,
            "max_pixels": 12845056,
            "patch_size": 14,
            "temporal_patch_size": 2,
            "merge_size": 2,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor" if spec.arch == "qwen2_5_vl" else "Qwen2VLProcessor",
            **(preprocessor or {}),
        },
        "tokenizer_config.json": _tokenizer_config(
            QWEN2_VL_CHAT_TEMPLATE
            if chat_template_in == "tokenizer_config.json"
            else QWEN2_5_CHAT_TEMPLATE
            if as_published and spec.arch == "qwen2_5_vl"
            else None
        ),
    }
    if chat_template_in == "chat_template.json":
        files["chat_template.json"] = {"chat_template": QWEN2_VL_CHAT_TEMPLATE}
    if chat_template_in == "chat_template.jinja":
        files["chat_template.jinja"] = QWEN2_VL_CHAT_TEMPLATE
    if weights is None:
        files["vlmserve_tiny.json"] = tiny_info(spec, seed)

    def write_rest(folder: Path) -> None:
        write_tokenizer_files(folder, [(FIRST_ADDED_ID + k, tok, True) for k, tok in enumerate(QWEN2_VL_ADDED_TOKENS)])
        save_weights(random_weights(spec, seed) if weights is None else weights, folder, num_shards)

    return write_checkpoint(out_dir, files, write_rest)
