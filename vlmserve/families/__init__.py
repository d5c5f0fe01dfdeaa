"""Model families, one folder each: config parsing, tokenizer and chat rendering, processor,
model and vision tower, tiny-checkpoint writer, and a `family.py` that describes the family to the
rest of vlmserve (vlmserve/family.py) and is listed once in vlmserve/registry.py. What several
families do the same way lives once in common/, which imports no family."""

# Each family's name and display name, in the registry's order, for what must not wait for torch
# (the command line's choices); vlmserve/registry.py checks it against the families themselves.
NAMES = {
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
    "qwen3_vl_moe": "Qwen3-VL-MoE",
    "qwen3_5": "Qwen3.5",
    "qwen3_5_moe": "Qwen3.5-MoE",
    "qwen_vl": "Qwen-VL-Chat",
}
