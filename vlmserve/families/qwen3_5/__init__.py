"""Qwen3.5: Gated DeltaNet linear attention with a gated full-attention layer every few layers,
and Qwen3-VL's vision tower without DeepStack."""
