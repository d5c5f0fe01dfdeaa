"""Qwen-VL-Chat (the first generation, config model_type "qwen"): its tiktoken tokenizer with
image spans, and its chatml chat format (make_context), without the checkpoint's remote code."""

from vlmserve.qwen_vl.tokenizer import QwenVLTokenizer

__all__ = ["QwenVLTokenizer"]
