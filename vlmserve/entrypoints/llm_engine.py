"""The in-process engine behind the offline LLM: a front end (tokenizer, processor, detokenizing
output processor) and an engine core (model, caches, scheduler) in one process, advanced one
step at a time."""

from __future__ import annotations

import logging

from vlmserve.api.frontend import load_frontend
from vlmserve.api.output_processor import OutputProcessor
from vlmserve.engine.banner import engine_summary, log_banner
from vlmserve.engine.config import EngineConfig
from vlmserve.engine.core import EngineCore, check_runner
from vlmserve.engine.model_runner import ModelRunner
from vlmserve.engine.request import RequestStatus
from vlmserve.lora.request import LoRARequest
from vlmserve.models.base import VLModel
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from vlmserve.pooling import PoolerConfig, PoolingParams
from vlmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.frontend = load_frontend(config)
        self.core = EngineCore(config, self.frontend.engine_model())
        self.output_processor = OutputProcessor(self.frontend.tokenizer)
        # Shortcuts to the parts callers and tests look at.
        self.tokenizer = self.frontend.tokenizer
        self.processor = self.frontend.processor
        self.model_dir = self.frontend.model_dir
        self.model_config = self.frontend.model_config
        self.eos_token_ids = self.frontend.eos_token_ids
        self.max_model_len = self.frontend.max_model_len
        self.kv = self.core.kv
        self.scheduler, self.memory_plan = self.core.scheduler, self.core.memory_plan
        # The pooling runner's pooler (None: a generation engine), and its requests in flight:
        # request id -> prompt token ids.
        self.pooler: PoolerConfig | None = self.core.model_info.pooler
        self.pooling: dict[str, list[int]] = {}
        # Pooling requests finished by steps, until take_pooled() takes them.
        self.pooled: list[PoolingRequestOutput] = []
        log_banner(logger, engine_summary(self.core, config.model), "vlmserve engine ready")

    @property
    def model(self) -> VLModel:
        """The model, where it is in this process (tensor_parallel_size 1)."""
        return self.core.model

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    def shutdown(self) -> None:
        """Stop the tensor-parallel rank processes, if any."""
        self.core.shutdown()

    def default_sampling_params(self) -> SamplingParams:
        return self.frontend.default_sampling_params()

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> None:
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_runner(self.pooler, None)  # a pooling model generates nothing
        self.core.check_fits(prompt)  # before anything is registered
        if lora_request is not None:
            self.core.add_lora(lora_request)  # LoRAError before anything is registered
        params = self.frontend.resolve_params(params)
        child_ids = self.output_processor.add_prompt(request_id, prompt, params)
        for index, child_id in enumerate(child_ids):
            self.core.add_request(child_id, prompt, params.for_child(index), lora_request=lora_request)

    def add_pooling_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: PoolingParams,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """A pooling model's request: its output (a PoolingRequestOutput) is its prompt's vector."""
        if request_id in self.output_processor.parents or request_id in self.pooling:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.core.check_fits(prompt)  # the core checks the runner and the params before it holds anything
        self.core.add_request(
            request_id, prompt, SamplingParams(max_tokens=1), lora_request=lora_request, pooling_params=params
        )
        self.pooling[request_id] = list(prompt.prompt_token_ids)

    # vLLM's LLMEngine.add_lora / remove_lora / list_loras (adapters by name here).
    def add_lora(self, lora_request: LoRARequest) -> None:
        self.core.add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        return self.core.remove_lora(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return self.core.list_loras()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if self.pooling.pop(request_id, None) is not None:
            self.core.finish_requests([request_id])
            return None
        output, child_ids = self.output_processor.abort(request_id)
        self.core.finish_requests(child_ids)
        return output

    def reset_prefix_cache(self) -> None:
        self.core.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def take_pooled(self) -> list[PoolingRequestOutput]:
        """The pooling requests finished since the last call (step() returns generation's)."""
        pooled, self.pooled = self.pooled, []
        return pooled

    def step(self) -> list[RequestOutput]:
        """ValueError: a request's grammar does not compile, or passed a limit (as adding it
        raised before grammars compiled in the background; the caller aborts its requests).
        RuntimeError: a pooling request failed in the engine (it is gone; the others go on).
        Pooling requests' outputs are take_pooled()'s."""
        core_outputs = self.core.step()
        pooled = self.pooled
        if self.pooling:
            for out in [o for o in core_outputs if o.request_id in self.pooling]:
                assert out.pooled is not None, "a pooling request's output carries its vector"
                prompt = self.pooling.pop(out.request_id)
                pooled.append(
                    PoolingRequestOutput(out.request_id, PoolingOutput(out.pooled), prompt, True, out.num_cached_tokens)
                )
            core_outputs = [o for o in core_outputs if o.pooled is None]
        outputs, stopped = self.output_processor.process(core_outputs)
        self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)  # stop strings found here
        # A request whose step failed (the engine went on without it) ends as aborted, with its
        # other samples; the error is logged. Nothing else in the batch is lost.
        failed = self.core.take_failed()
        pooling_failed = []
        for request_id in [r for r in failed if self.pooling.pop(r, None) is not None]:
            pooling_failed.append(f"pooling request {request_id} failed in the engine: {failed[request_id]}")
        for child_id, message in failed.items():
            sample = self.output_processor.samples.get(child_id)
            if sample is None:
                continue
            logger.error("request %s failed: %s", sample.parent.request_id, message)
            aborted = self.abort_request(sample.parent.request_id)
            if aborted is not None:
                outputs.append(aborted)
        for child_id, message in self.core.take_refused().items():
            sample = self.output_processor.samples.get(child_id)
            if sample is not None:
                self.abort_request(sample.parent.request_id)
                raise ValueError(message)
        if pooling_failed:
            raise RuntimeError("; ".join(pooling_failed))
        return outputs
