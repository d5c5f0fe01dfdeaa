"""The engine: loads a checkpoint, owns the scheduler, the model runner and the output processor,
and advances every request by one step at a time."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlmserve.attention import select_backend
from vlmserve.config import ModelConfig, parse_dtype
from vlmserve.engine.kv_cache import KVCacheManager
from vlmserve.engine.memory import MemoryPlan, default_budget, plan_kv_cache
from vlmserve.engine.model_runner import ModelRunner
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

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    revision: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    # Tokens per step; None: 2048 on the CPU (a step of 8192 prefill tokens runs for tens of
    # seconds on a 2B-class model there, stalling every decoding request), 8192 on CUDA.
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    # Memory the engine may use in all (weights, activations, encoder cache, KV cache);
    # None: 90% of a CUDA device, half the available RAM on the CPU.
    memory_budget_bytes: int | None = None
    # A fixed KV cache size instead of planning one from the budget (skips the profile run).
    kv_cache_memory_bytes: int | None = None
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 8})
    # Engine-wide overrides of preprocessor_config.json (min_pixels, max_pixels).
    mm_processor_kwargs: dict[str, int] = field(default_factory=dict)
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
        unknown = set(config.mm_processor_kwargs) - {"min_pixels", "max_pixels"}
        if unknown:
            raise ValueError(f"mm_processor_kwargs: unknown keys {sorted(unknown)}; supported: min_pixels, max_pixels")
        preprocessor = read_json(self.model_dir / "preprocessor_config.json") | dict(config.mm_processor_kwargs)
        self.processor = Qwen2VLProcessor(
            self.model_config,
            self.tokenizer,
            ImageProcessorConfig.from_dict(preprocessor),
            ProcessorLimits(self.max_model_len, dict(config.limit_mm_per_prompt)),
            config.media_limits,
        )
        eos = self.generation_config.get("eos_token_id", self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or [])

        budget = config.max_num_batched_tokens or (2048 if self.device.type == "cpu" else 8192)
        # The batched-decode workspace bounds a step's transient memory; the plan measures it.
        backend = select_backend(self.device, decode_workspace_tokens=self.max_model_len)
        self.model = build_model(self.model_config, self.model_dir, backend, self.device, self.dtype)
        self.runner = ModelRunner(self.model, self.device, self.dtype)
        largest_image = self.processor.max_tokens_per_item()["image"]
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_encoder_tokens_per_step=max(budget, largest_image),
            encoder_cache_tokens=config.encoder_cache_tokens or max(budget, largest_image),
        )
        self.memory_plan = self._plan_memory(scheduler_config, largest_image)
        logger.info(self.memory_plan.describe())
        self.kv = KVCacheManager(self.memory_plan.num_blocks, config.block_size, config.enable_prefix_caching)
        self.runner.bind_kv_cache(self.kv)
        self.scheduler = Scheduler(scheduler_config, self.kv)
        self.output_processor = OutputProcessor(self.tokenizer)

    def _plan_memory(self, sched: SchedulerConfig, largest_image: int) -> MemoryPlan:
        config = self.config
        block_bytes = self.runner.kv_bytes_per_token * config.block_size
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        dtype_size = torch.empty((), dtype=self.dtype).element_size()
        encoder_cache = sched.encoder_cache_tokens * self.model_config.text.hidden_size * dtype_size
        per_seq = -(-self.max_model_len // config.block_size)
        if config.kv_cache_memory_bytes is not None:
            fixed = config.kv_cache_memory_bytes // block_bytes
            if fixed < 1:
                raise ValueError(
                    f"kv_cache_memory of {config.kv_cache_memory_bytes} bytes holds no {block_bytes}-byte block"
                )
            budget, activations, min_blocks, profiled = weights + encoder_cache + fixed * block_bytes, 0, 1, False
        else:
            count = max(1, sched.max_encoder_tokens_per_step // largest_image)
            dummy = self.processor.dummy_items(count, largest_image)
            activations = self.runner.profile_run(
                dummy, sched.max_num_batched_tokens, self.max_model_len, config.max_num_seqs, config.block_size
            )
            budget = config.memory_budget_bytes or default_budget(self.device)
            min_blocks, profiled = per_seq, True
        return plan_kv_cache(
            budget_bytes=budget,
            weights_bytes=weights,
            activation_bytes=activations,
            encoder_cache_bytes=encoder_cache,
            block_bytes=block_bytes,
            block_size=config.block_size,
            min_blocks=min_blocks,
            max_useful_blocks=per_seq * config.max_num_seqs,
            profiled=profiled,
        )

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

    def reset_prefix_cache(self) -> None:
        """Forget cached KV blocks and encoder outputs that no running request holds."""
        self.kv.pool.forget_free_blocks()
        self.scheduler.encoder_cache.evict_unused()
        self.runner.free_encoder_outputs(self.scheduler.encoder_cache.take_freed())

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
