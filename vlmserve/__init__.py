"""vlmserve: a serving engine for the Qwen vision-language family."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlmserve.api.beam_search import BeamSearchParams
    from vlmserve.entrypoints.llm import LLM
    from vlmserve.outputs import CompletionOutput, RequestOutput
    from vlmserve.pooling import PoolingParams
    from vlmserve.sampling_params import SamplingParams

from vlmserve.version import __version__

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

# Imported on first use, so that `vlmserve --help` and the command line's checks of its
# arguments do not wait for torch.
_LAZY = {
    "LLM": "vlmserve.entrypoints.llm",
    "BeamSearchParams": "vlmserve.api.beam_search",
    "CompletionOutput": "vlmserve.outputs",
    "RequestOutput": "vlmserve.outputs",
    "SamplingParams": "vlmserve.sampling_params",
    "PoolingParams": "vlmserve.pooling",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vlmserve' has no attribute {name!r}")
