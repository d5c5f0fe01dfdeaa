"""Qwen2-VL and Qwen2.5-VL: one family with two architectures that share the decoder (M-RoPE),
the processor (smart_resize, merged patches, video), the chat template and the checkpoint layout;
Qwen2.5-VL brings its window-attention vision tower and absolute-time video positions."""
