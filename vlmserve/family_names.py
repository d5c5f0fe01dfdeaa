"""Each registered family's name and display name, in the registry's order, for what must not wait
for torch (the command line's choices: a usage error is said at once). vlmserve/registry.py
checks this list against the families themselves when it is imported."""

NAMES = {
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
    "qwen3_vl_moe": "Qwen3-VL-MoE",
    "qwen3_5": "Qwen3.5",
    "qwen3_5_moe": "Qwen3.5-MoE",
    "qwen_vl": "Qwen-VL-Chat",
}
