"""vlmserve: a serving engine for the Qwen vision-language family."""

from vlmserve.entrypoints.llm import LLM
from vlmserve.outputs import CompletionOutput, RequestOutput
from vlmserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
