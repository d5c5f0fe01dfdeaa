"""vlmserve: a serving engine for the Qwen vision-language family."""

from vlmserve.entrypoints.llm import LLM
from vlmserve.outputs import CompletionOutput, RequestOutput
from vlmserve.sampling_params import SamplingParams
from vlmserve.version import __version__

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
