"""Qwen-VL-Chat (the first generation, config model_type "qwen"), without the checkpoint's remote
code: its tiktoken tokenizer with image spans, its chatml chat format (make_context), its
processor, and the QWen decoder with the 448 px ViT + Resampler."""
