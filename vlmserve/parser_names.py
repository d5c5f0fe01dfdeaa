"""The values `vlmserve serve --reasoning-parser` and `--tool-call-parser` take: vLLM's names for
the parsers vlmserve implements (vLLM's flags, so that a `vllm serve` command line carries over)."""

from __future__ import annotations

# vLLM's "qwen3": <think>...</think> split off as reasoning_content (vlmserve/api/reasoning.py).
REASONING_PARSERS = ("qwen3",)
# vLLM's "hermes": <tool_call>{...}</tool_call> blocks (vlmserve/api/tool_parsers.py); vLLM's
# "qwen3_coder": Qwen3.5's <tool_call><function=...><parameter=...> blocks (vlmserve/api/qwen3_coder_tools.py).
TOOL_CALL_PARSERS = ("hermes", "qwen3_coder")
