"""The values `vlmserve serve --reasoning-parser` and `--tool-call-parser` take: vLLM's names for
the parsers vlmserve implements (vLLM's flags, so that a `vllm serve` command line carries over)."""

from __future__ import annotations

# vLLM's "qwen3": <think>...</think> split off as reasoning_content (vlmserve/api/reasoning.py).
REASONING_PARSERS = ("qwen3",)
# vLLM's "hermes": <tool_call>{...}</tool_call> blocks (vlmserve/api/tool_parsers.py), the format
# of Qwen2.5-VL's and Qwen3-VL's templates.
JSON_TOOL_CALL_PARSER = "hermes"
# vLLM's "qwen3_coder": <tool_call><function=...><parameter=...> blocks (vlmserve/api/xml_tool_parser.py),
# the format of Qwen3.5's (and Qwen3-Coder's) templates.
XML_TOOL_CALL_PARSER = "qwen3_coder"
TOOL_CALL_PARSERS = (JSON_TOOL_CALL_PARSER, XML_TOOL_CALL_PARSER)
