"""Engine options, and how "auto" device and dtype resolve."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlmserve.config import parse_dtype
from vlmserve.engine.speculative import SpeculativeConfig
from vlmserve.multimodal.media import MediaLimits


@dataclass(frozen=True)
class EngineConfig:
    model: str
    revision: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    # Linear layers' quantization (vLLM's --quantization): None (the checkpoint's: float, or AWQ /
    # GPTQ as published), "int8" (weight-only, made at load), "awq", "gptq".
    quantization: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    # Tokens per step; None: 2048 on the CPU (a step of 8192 prefill tokens runs for tens of
    # seconds on a 2B-class model there, stalling every decoding request), 8192 on CUDA.
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    # Memory the engine may use in all (weights, activations, encoder cache, KV cache);
    # None: gpu_memory_utilization of a CUDA device, half the available RAM on the CPU.
    memory_budget_bytes: int | None = None
    # vLLM's name: the fraction of the CUDA device's memory the engine plans with (memory.py:
    # default_budget); unused on the CPU and where memory_budget_bytes is given.
    gpu_memory_utilization: float = 0.9
    # A fixed KV cache size instead of planning one from the budget (skips the profile run).
    kv_cache_memory_bytes: int | None = None
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 8})
    # Engine-wide overrides of preprocessor_config.json (min_pixels, max_pixels).
    mm_processor_kwargs: dict[str, int] = field(default_factory=dict)
    enable_prefix_caching: bool = True
    # A model with recurrent state (Qwen3.5), with prefix caching: where a prompt's state is saved
    # for reuse (engine/state_cache.py): the end of its first and of its last message, its last
    # full block, and every state_save_interval tokens (rounded down to whole blocks; 0: none by
    # interval); saved_state_slots states are kept (None: max_num_seqs), least recently used
    # evicted, planned in the memory budget.
    state_save_interval: int = 1024
    saved_state_slots: int | None = None
    # Encoder outputs held at once, in tokens; None: enough for a step's worth or the largest image.
    encoder_cache_tokens: int | None = None
    media_limits: MediaLimits = field(default_factory=MediaLimits)
    # Where requests' sampling defaults come from, as vLLM's --generation-config: "auto" (the
    # checkpoint's generation_config.json), "vllm" (vLLM's neutral defaults), or a folder holding
    # a generation_config.json.
    generation_config: str = "auto"
    # vLLM's --max-logprobs: the most logprobs / prompt_logprobs a request may ask for (-1: no
    # bound below the vocabulary, which also lets a request ask for -1, the whole vocabulary).
    max_logprobs: int = 20
    # Structured outputs (engine/structured_output.py): the compiled grammars the engine holds, in
    # bytes (least recently used evicted; one in use stays; on the CPU the KV cache is planned after
    # it), and the CPU seconds one grammar's compile may take before its requests are refused.
    grammar_cache_bytes: int = 512 << 20
    max_grammar_compile_seconds: float = 5.0
    # Speculative decoding, vLLM's speculative_config (engine/speculative.py): {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b} or {"method":
    # "mtp", "num_speculative_tokens": k}; None: off.
    speculative_config: dict[str, Any] | None = None
    # LoRA adapters (vlmserve/lora), vLLM's names: enable_lora builds the low-rank slots into the
    # model's linear layers; max_loras adapters may run in one step (each row its own or none),
    # each of rank up to max_lora_rank; max_cpu_loras adapters are kept loaded (None: max_loras),
    # the least recently used dropped first (loaded again from its folder when asked for).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's --runner: "generate" (sample tokens), "pooling" (prompts only, each returning a vector:
    # embeddings or reranker scores, vlmserve/pooling.py) or "auto" (pooling for a checkpoint that
    # is an embedding model by its sentence-transformers files, or asked to score by hf_overrides).
    runner: str = "auto"
    # vLLM's --hf-overrides: keys over config.json; read here for pooling (classifier_from_token,
    # is_matryoshka, matryoshka_dimensions; "architectures" naming a ...ForSequenceClassification).
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # "auto" (triton on CUDA where installed, else torch), "torch" or "triton" (attention/__init__.py).
    attention_backend: str = "auto"
    # vLLM's name: no CUDA graphs (engine/cuda_graphs.py), every step eager.
    enforce_eager: bool = False
    # Tensor parallelism (engine/executor.py): the model on this many ranks, one process each
    # (one device each on CUDA), spread evenly over `nnodes` machines; this one is `node_rank`
    # (0 runs the engine core). The ranks meet at master_addr:master_port (None: a free port,
    # one machine only). memory_budget_bytes is then per rank.
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # A local rank not heard from (its heartbeat thread beats every RANK_BEAT_S) for this long is
    # stopped or hung: its step fails and the ranks are stopped, as when one dies. The server sets
    # it to --engine-stall-timeout.
    rank_stall_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.state_save_interval < 0:
            raise ValueError(f"state_save_interval must be 0 (off) or tokens, got {self.state_save_interval}")
        if self.saved_state_slots is not None and self.saved_state_slots < 1:
            raise ValueError(f"saved_state_slots must be at least 1, got {self.saved_state_slots}")
        if self.grammar_cache_bytes < 1:
            raise ValueError(f"grammar_cache_bytes must be positive, got {self.grammar_cache_bytes}")
        if not 0 < self.max_grammar_compile_seconds < float("inf"):
            raise ValueError(f"max_grammar_compile_seconds must be positive, got {self.max_grammar_compile_seconds}")
        check_parallel_layout(self.tensor_parallel_size, self.nnodes, self.node_rank)
        SpeculativeConfig.parse(self.speculative_config)  # ValueError naming what is wrong
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("nnodes > 1 needs master_port (and master_addr: node 0's address), the same on every node")
        if self.nnodes > 1 and self.node_rank != 0:
            raise ValueError(f"the engine runs on node 0; node {self.node_rank} runs `vlmserve worker` instead")


def check_parallel_layout(tensor_parallel_size: int, nnodes: int, node_rank: int) -> None:
    """ValueError naming what is wrong with a tensor-parallel layout."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    if nnodes < 1:
        raise ValueError(f"nnodes must be at least 1, got {nnodes}")
    if tensor_parallel_size % nnodes:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} does not split evenly over {nnodes} nodes")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in 0..{nnodes - 1}, got {node_rank}")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}; use 'cpu', 'cuda' or 'auto'")
    return resolved


def resolve_dtype(dtype: str, checkpoint_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return parse_dtype(dtype)
    resolved = checkpoint_dtype or torch.float32
    # float16 matrix products are slow on CPUs; bfloat16 has the same size and range enough.
    if device.type == "cpu" and resolved == torch.float16:
        return torch.bfloat16
    return resolved
