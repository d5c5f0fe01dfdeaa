"""Qwen3-VL, dense and MoE: a vision tower with learned position embeddings and DeepStack
features, a Qwen3 decoder with interleaved M-RoPE, and timestamped videos."""
