"""The engine: loads a checkpoint, owns the scheduler, the model runner and the output processor,
and advances every request by one step at a time."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlmserve.attention import select_backend
from vlmserve.config import ModelConfig, parse_dtype
from vlmserve.engine.kv_cache import KVCacheManager
from vlmserve.engine.model_runner import ModelRunner, kv_bytes_per_token
from vlmserve.engine.output_processor import OutputProcessor
from vlmserve.engine.request import Request, RequestStatus
from vlmserve.engine.scheduler import Scheduler, SchedulerConfig
from vlmserve.model_files import read_json, resolve_model_dir
from vlmserve.models import build_model
from vlmserve.multimodal.image import ImageProcessorConfig
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.multimodal.media import MediaLimits
from vlmserve.outputs import RequestOutput
from vlmserve.processor.qwen2_vl import ProcessorLimits, Qwen2VLProcessor
from vlmserve.sampling_params import SamplingParams
from vlmserve.tokenizer import Tokenizer

GiB = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    model: str
    revision: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    # KV cache size; None: room for max_num_seqs full-length sequences, capped at 4 GiB.
    kv_cache_memory_bytes: int | None = None
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 8})
    enable_prefix_caching: bool = True
    # Encoder outputs held at once, in tokens; None: enough for a step's worth or the largest image.
    encoder_cache_tokens: int | None = None
    media_limits: MediaLimits = field(default_factory=MediaLimits)


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


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir: Path = resolve_model_dir(config.model, config.revision)
        self.model_config = ModelConfig.from_file(self.model_dir / "config.json")
        self.tokenizer = Tokenizer(self.model_dir)
        self.generation_config = read_json(self.model_dir / "generation_config.json")
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config.checkpoint_dtype, self.device)

        limit = self.model_config.text.max_position_embeddings
        self.max_model_len = config.max_model_len or limit
        if not 1 < self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in 2..{limit} (max_position_embeddings), got {self.max_model_len}")
        self.processor = Qwen2VLProcessor(
            self.model_config,
            self.tokenizer,
            ImageProcessorConfig.from_dict(read_json(self.model_dir / "preprocessor_config.json")),
            ProcessorLimits(self.max_model_len, dict(config.limit_mm_per_prompt)),
            config.media_limits,
        )
        eos = self.generation_config.get("eos_token_id", self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or [])

        backend = select_backend(self.device)
        self.model = build_model(self.model_config, self.model_dir, backend, self.device, self.dtype)
        per_token = kv_bytes_per_token(self.model, self.dtype)
        budget = config.kv_cache_memory_bytes
        if budget is None:
            budget = min(4 * GiB, per_token * self.max_model_len * config.max_num_seqs)
        num_blocks = budget // (per_token * config.block_size)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        largest_image = min(self.processor.max_tokens_per_image(), self.max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_encoder_tokens_per_step=max(config.max_num_batched_tokens, largest_image),
            encoder_cache_tokens=config.encoder_cache_tokens or max(config.max_num_batched_tokens, largest_image),
        )
        self.scheduler = Scheduler(scheduler_config, self.kv)
        self.runner = ModelRunner(self.model, self.kv, self.device, self.dtype)
        self.output_processor = OutputProcessor(self.tokenizer)

    def default_sampling_params(self) -> SamplingParams:
        """Sampling defaults from generation_config.json, as vLLM applies them."""
        g = self.generation_config
        return SamplingParams(
            temperature=float(g.get("temperature", 1.0)),
            top_p=float(g.get("top_p", 1.0)),
            top_k=int(g.get("top_k", 0)),
        )

    def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams) -> None:
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.scheduler.check_fits(prompt.num_tokens, [item.length for item in prompt.mm_items])
        num_image_tokens = [item.length for item in prompt.mm_items]
        child_ids = self.output_processor.add_request(
            request_id, prompt.prompt, prompt.prompt_token_ids, num_image_tokens, params
        )
        for index, child_id in enumerate(child_ids):
            child = Request(child_id, prompt, params.for_child(index), self.eos_token_ids, self.max_model_len)
            self.scheduler.add_request(child)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        output, child_ids = self.output_processor.abort(request_id)
        for child_id in child_ids:
            self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
        return output

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        sampled = self.runner.execute(step)
        if not step.scheduled:
            return []
        updated = self.scheduler.update_from_output(step, sampled)
        outputs, stopped = self.output_processor.process(updated)
        for request_id in stopped:  # a stop string ended these: free them now
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
        return outputs
