"""The engine core: the model, its caches and the scheduler. It takes processed requests and
returns, step by step, the token ids each request received; detokenizing and stop strings are
the front end's business. The server runs it in its own process; the offline LLM in-process."""

from __future__ import annotations

import logging

import torch

from vlmserve.attention import select_backend
from vlmserve.engine.cache_coordinator import CacheCoordinator
from vlmserve.engine.checkpoint import EngineModel
from vlmserve.engine.config import EngineConfig, resolve_device, resolve_dtype
from vlmserve.engine.executor import ExecutorError, InProcessExecutor, make_executor
from vlmserve.engine.memory import MemoryPlan, plan_kv_cache
from vlmserve.engine.model_runner import KEEP_POSITION_STATES, ModelRunner
from vlmserve.engine.request import Request, RequestStatus
from vlmserve.engine.scheduler import Scheduler, SchedulerConfig
from vlmserve.engine.speculative import DraftBackoff, NgramIndex, SpeculativeConfig, SpeculativeStats
from vlmserve.engine.structured_output import GrammarCompiler, StructuredOutputs
from vlmserve.ipc.contracts import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from vlmserve.ipc.worker_messages import RankInfo
from vlmserve.lora.request import AdapterInfo, LoRAError, LoRARequest
from vlmserve.models.base import VLModel
from vlmserve.multimodal.inputs import ProcessedPrompt
from vlmserve.pooling import PoolerConfig, PoolingParams
from vlmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# How long a step with nothing to run but grammars compiling waits for one (then returns, so
# that the caller takes new requests and aborts meanwhile).
GRAMMAR_WAIT_S = 0.02


class EngineCore:
    def __init__(self, config: EngineConfig, model: EngineModel, log_stats: bool = False) -> None:
        """`log_stats`: outputs carry each request's events (queued, scheduled, preempted), for
        the server's per-request metrics."""
        self.config = config
        self.model_info = model
        self.max_model_len = model.max_model_len
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model.model_config.checkpoint_dtype, self.device)
        budget = config.max_num_batched_tokens or (2048 if self.device.type == "cpu" else 8192)
        self.speculative = SpeculativeConfig.parse(config.speculative_config)
        # The batched-decode workspace bounds a step's transient memory; the plan measures it.
        self.backend = select_backend(self.device, config.attention_backend, decode_workspace_tokens=self.max_model_len)
        # Structured outputs' grammars compile on threads of their own while the other requests
        # run; the compiled grammars and the matchers live here and fill each step's masks once,
        # for every rank.
        self.grammars = GrammarCompiler(
            self._load_vocabulary, model.model_config.text.vocab_size, sorted(model.eos_token_ids)
        )
        self.structured_outputs = StructuredOutputs(
            self.grammars, config.grammar_cache_bytes, config.max_grammar_compile_seconds
        )
        # The model and its runner: in this process, or on tensor_parallel_size rank processes.
        self.executor = make_executor(config, model.model_dir, self.device, self.backend)
        # The largest image or video a prompt may hold: the encoder must take it in one step.
        limits = model.processing.max_items_per_prompt()
        per_item = {m: n for m, n in model.processing.max_tokens_per_item().items() if limits.get(m, 0) > 0}
        largest_modality = max(per_item, key=lambda m: per_item[m], default="image")
        largest_item = per_item.get(largest_modality, 1)
        scheduler_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=budget,
            max_encoder_tokens_per_step=max(budget, largest_item),
            encoder_cache_tokens=config.encoder_cache_tokens or max(budget, largest_item),
            draft_lookahead=self.speculative.num_speculative_tokens
            if self.speculative is not None and self.speculative.method == "mtp"
            else 0,
            max_loras=config.max_loras if config.enable_lora else 0,
        )
        # Logged once, with the rest of the start-up banner (engine/banner.py), by whoever built it.
        self.memory_plan = self._plan_memory(scheduler_config, largest_modality, largest_item)
        self.kv = CacheCoordinator.build(
            self.memory_plan.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            self.slot_groups,
            config.state_save_interval,
            self.model_info.eos_token_ids,
        )
        graphs = self._use_cuda_graphs()
        # With CUDA graphs, one block more than the scheduler hands out: padded decode rows' scratch.
        self.executor.bind_caches(
            self.kv.pool.num_blocks + graphs, self.kv.block_size, [g.num_slots for g in self.slot_groups]
        )
        if graphs:
            self._capture_decode_graphs()
        self.scheduler = Scheduler(scheduler_config, self.kv, log_stats)
        # Requests an error in the engine failed, with why, since the last take_failed(); requests
        # refused for their grammar (the request's fault, not the engine's), since take_refused().
        self.failed: dict[str, str] = {}
        self.refused: dict[str, str] = {}
        # Since start: prompt tokens computed (again after a preemption) and tokens generated,
        # for the periodic throughput lines.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        # Speculative decoding's drafts verified and accepted since start (all zero without it).
        self.spec_stats = SpeculativeStats.empty(self.speculative)
        # LoRA adapters loaded, by name: the request, what the ranks said of it, and the key its
        # cached KV and encoder outputs go under (a new one each time a name is loaded, so that a
        # name loaded again from changed files never meets its old cache entries).
        self.loras: dict[str, tuple[LoRARequest, AdapterInfo, str]] = {}
        self._lora_loads = 0

    @property
    def runner(self) -> ModelRunner:
        """The model runner, where it is in this process (tensor_parallel_size 1)."""
        if not isinstance(self.executor, InProcessExecutor):
            raise AttributeError("the model runner lives in the tensor-parallel rank processes")
        return self.executor.runner

    @property
    def model(self) -> VLModel:
        """The model, where it is in this process (tensor_parallel_size 1)."""
        return self.runner.model

    def shutdown(self) -> None:
        """Stop the rank processes, if any (the engine cannot run steps after this)."""
        self.structured_outputs.shutdown()
        self.executor.shutdown()

    def _use_cuda_graphs(self) -> bool:
        """Decode steps from CUDA graphs: on CUDA, with a backend reading the step's layout from
        device tensors (triton), for models with paged KV alone (no slot groups), in this process
        (not yet in rank processes); off with enforce_eager."""
        return (
            self.device.type == "cuda"
            and self.backend.name == "triton"
            and not self.config.enforce_eager
            and isinstance(self.executor, InProcessExecutor)
            and not self.slot_groups
        )

    def _capture_decode_graphs(self) -> None:
        from vlmserve.engine.cuda_graphs import cuda_capture

        try:
            self.runner.capture_decode_graphs(self.config.max_num_seqs, self.max_model_len, cuda_capture(self.device))
        except Exception:  # a forward that syncs with the host (MoE routing counts) cannot be captured
            logger.warning("CUDA graph capture failed; decode steps run eagerly", exc_info=True)
            self.runner.decode_graphs = None
            torch.cuda.synchronize(self.device)

    def _plan_memory(self, sched: SchedulerConfig, largest_modality: str, largest_item: int) -> MemoryPlan:
        """Each rank's plan from its own weights, profile peak and budget; the KV cache every rank
        can hold is the smallest of them (the scheduler's blocks exist on every rank)."""
        config = self.config
        if config.kv_cache_memory_bytes is not None:
            ranks = self.executor.plan(None)
        else:
            # A step may encode max_encoder_tokens_per_step tokens of items each no larger than
            # the largest. A dummy can hold fewer tokens than asked (a video's frames are capped,
            # so a prompt-long one is whole frames and less): top up with what is left.
            processor, step_tokens = self.model_info.processing, sched.max_encoder_tokens_per_step
            dummy = processor.dummy_items(max(1, step_tokens // largest_item), largest_item, largest_modality)
            short = step_tokens - sum(item.length for item in dummy)
            if short > 0:
                dummy += [i for i in processor.dummy_items(1, short, largest_modality) if i.length <= short]
            ranks = self.executor.plan(
                dummy, sched.max_num_batched_tokens, self.max_model_len, config.max_num_seqs, config.block_size
            )
        # Besides the paged KV, the fixed-size per-request memory the model's layers declare.
        self.slot_groups = CacheCoordinator.slot_groups(
            max(rank.slot_bytes for rank in ranks),
            config.max_num_seqs,
            config.enable_prefix_caching,
            config.saved_state_slots,
        )
        return min((self._plan_rank(rank, sched) for rank in ranks), key=lambda plan: plan.num_blocks)

    def _plan_rank(self, rank: RankInfo, sched: SchedulerConfig) -> MemoryPlan:
        config = self.config
        block_bytes = rank.kv_bytes_per_token * config.block_size
        weights = rank.weights_bytes
        dtype_size = torch.empty((), dtype=self.dtype).element_size()
        model_config = self.model_info.model_config
        encoder_cache = (
            sched.encoder_cache_tokens * model_config.text.hidden_size * model_config.mm_embedding_rows * dtype_size
        )
        per_seq = -(-self.max_model_len // config.block_size)
        slot_groups = CacheCoordinator.slot_groups(
            rank.slot_bytes, config.max_num_seqs, config.enable_prefix_caching, config.saved_state_slots
        )
        slot_bytes = sum(group.bytes for group in slot_groups)
        if self.speculative is not None and rank.slot_bytes:
            # A verification keeps each verifying request's state from before it and after each of
            # its k + 1 tokens (one is put back when a draft is rejected), for the step.
            kept = 1 + (self.speculative.num_speculative_tokens + 1 if KEEP_POSITION_STATES else 0)
            slot_bytes += config.max_num_seqs * kept * rank.slot_bytes
        # The compiled grammars live in the engine core's host memory: on the CPU, where the KV
        # cache does too, the KV cache is sized after them (every rank's: they share the machine).
        grammars_in_budget = self.device.type == "cpu"
        grammar_bytes = config.grammar_cache_bytes if grammars_in_budget else 0
        if config.kv_cache_memory_bytes is not None:
            fixed = config.kv_cache_memory_bytes // block_bytes
            if fixed < 1:
                raise ValueError(
                    f"kv_cache_memory of {config.kv_cache_memory_bytes} bytes holds no {block_bytes}-byte block"
                )
            budget = weights + encoder_cache + slot_bytes + grammar_bytes + fixed * block_bytes
            activations, min_blocks, profiled = 0, 1, False
        else:
            activations = rank.activation_bytes
            budget = config.memory_budget_bytes or rank.budget_bytes
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
            state_cache_bytes=slot_bytes,
            grammar_cache_bytes=config.grammar_cache_bytes,
            grammar_cache_in_budget=grammars_in_budget,
        )

    def _load_vocabulary(self) -> list[bytes]:
        """Each token's bytes, for structured outputs (read once, at the first grammar)."""
        tokenizer = self.model_info.family.load_tokenizer(self.model_info.model_dir)
        return [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]

    def check_fits(self, prompt: ProcessedPrompt) -> None:
        self.scheduler.check_fits(prompt.num_tokens, [item.length for item in prompt.mm_items])

    # -- LoRA adapters ---------------------------------------------------------------------------

    def add_lora(self, lora: LoRARequest) -> None:
        """Load an adapter on every rank (nothing to do where it is loaded already under this
        name and path); LoRAError naming what is wrong where it cannot be served."""
        if not self.config.enable_lora:
            raise LoRAError(
                f"adapter {lora.lora_name!r}: LoRA adapters are off; "
                "start the engine with enable_lora=True (--enable-lora)"
            )
        held = self.loras.get(lora.lora_name)
        if held is not None:
            if held[0] == lora:
                return
            raise LoRAError(
                f"adapter {lora.lora_name!r} is loaded already from {held[0].lora_path} (id {held[0].lora_int_id}); "
                "unload it first to load another under its name"
            )
        same_id = [name for name, (other, _, _) in self.loras.items() if other.lora_int_id == lora.lora_int_id]
        if same_id:
            raise LoRAError(f"adapter {lora.lora_name!r}: lora_int_id {lora.lora_int_id} is adapter {same_id[0]!r}'s")
        info = self.executor.add_lora(lora)
        self._lora_loads += 1
        self.loras[lora.lora_name] = (lora, info, f"{lora.lora_name}#{self._lora_loads}")

    def remove_lora(self, lora_name: str) -> bool:
        """Forget an adapter (requests running with it finish with it); False where none of that
        name is loaded."""
        if self.loras.pop(lora_name, None) is None:
            return False
        if not any(r.lora_request is not None and r.lora_request.lora_name == lora_name for r in self._all_requests()):
            self.executor.remove_lora(lora_name)
        return True

    def list_loras(self) -> list[LoRARequest]:
        return [lora for lora, _, _ in self.loras.values()]

    def lora_requests_info(self) -> tuple[list[str], list[str]]:
        """The adapters of the running requests and of the waiting ones (vLLM's lora_requests_info)."""
        running = {r.lora_request.lora_name for r in self.scheduler.running if r.lora_request is not None}
        waiting = {r.lora_request.lora_name for r in self.scheduler.waiting if r.lora_request is not None}
        return sorted(running), sorted(waiting)

    def _all_requests(self) -> list[Request]:
        return [*self.scheduler.running, *self.scheduler.waiting]

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        owner: str = "",
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        """One sample (n == 1); the front end fans out n > 1. pooling_params: a pooling request
        (a pooling runner's only kind): its output is its prompt's pooled vector. `owner`: whom the scheduler shares
        the engine among (see vlmserve.engine.scheduler). ValueError: an id in use, or a request
        that can never fit; LoRAError: an adapter that cannot be served (loaded here on first
        use). One with a grammar not compiled yet is queued once it is (a spec that does not
        compile: take_refused() names it)."""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request %s: prompt token ids %s", request_id, list(prompt.prompt_token_ids))
        if request_id in self.structured_outputs.waiting:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_runner(self.model_info.pooler, pooling_params)
        lora = None
        if lora_request is not None:
            self.add_lora(lora_request)
            held, info, key = self.loras[lora_request.lora_name]
            lora = (held, key, info.vision)
        request = Request(
            request_id, prompt, params, self.model_info.eos_token_ids, self.max_model_len, owner, lora, pooling_params
        )
        if self.speculative is not None:
            request.backoff = DraftBackoff(self.speculative.num_speculative_tokens)
        if params.structured_outputs is None:
            self.scheduler.add_request(request)
            return
        self.scheduler.check_fits(request.num_prompt_tokens, [item.length for item in request.mm_items])
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.structured_outputs.add(request):  # its grammar is compiled: queued now
            self.scheduler.add_request(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Stop requests now (aborted, or a stop string found by the front end); frees everything."""
        for request_id in request_ids:
            self.scheduler.finish_request(request_id, status)
        self.structured_outputs.remove(request_ids)
        for request_id in request_ids:
            self.refused.pop(request_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget cached KV blocks and encoder outputs that no running request holds."""
        self.kv.forget_cached()
        self.scheduler.encoder_cache.evict_unused()
        self.executor.free_encoder_outputs(self.scheduler.encoder_cache.take_freed())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.structured_outputs.waiting)

    def step(self) -> list[EngineCoreOutput]:
        """One step: schedule, execute, update. No error in it ends the engine: a request whose
        computation or update raises is failed alone (take_failed() names it) and the others get
        the tokens they would have had without it; an error that cannot be pinned on one request
        (in schedule(), or leaving the caches in an unknown state) fails every request in flight
        and the engine goes on from empty caches. Requests whose grammar compiled meanwhile are
        queued first; with none to run while grammars compile, it waits for one (at most
        GRAMMAR_WAIT_S) and returns no output."""
        self._queue_compiled()
        if not self.scheduler.has_unfinished() and self.structured_outputs.waiting:
            self.structured_outputs.wait(GRAMMAR_WAIT_S)
            self._queue_compiled()
            return []
        # Otherwise a step runs even with nothing scheduled: it tells the runner which requests
        # finished since the last one, so that it forgets them.
        try:
            self._propose_drafts()
            scheduler_output = self.scheduler.schedule()
            self._count_prompt_tokens(scheduler_output)
            self._fill_grammar_masks(scheduler_output)
            runner_output = self._execute(scheduler_output)
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        except ExecutorError:
            raise  # a rank is gone: no step can run any more
        except Exception:
            logger.exception("an engine step failed outside any one request; failing every request in flight")
            for request_id in self.scheduler.reset():
                self.failed[request_id] = "the engine's state was reset after an error"
            self.structured_outputs.remove(list(self.structured_outputs.matchers))
            self.executor.reset()
            return []
        for request_id in self.scheduler.take_failed():
            self.failed[request_id] = "updating this request raised"
        for output in outputs:
            self.structured_outputs.accept(output.request_id, output.new_token_ids)
        self.structured_outputs.remove(
            [o.request_id for o in outputs if o.finish_reason is not None] + list(self.failed)
        )
        self.num_generation_tokens += sum(len(output.new_token_ids) for output in outputs)
        self.spec_stats.add(outputs)
        return outputs

    def _propose_drafts(self) -> None:
        """N-gram drafts for every decoding request that drafts this step (engine/speculative.py),
        up to the first its grammar does not allow and to its max_tokens; a draft head's (mtp)
        come with the step's output instead."""
        spec = self.speculative
        if spec is None:
            return
        for request in self.scheduler.running:
            if not request.is_decoding or request.backoff is None:
                continue
            if spec.method != "ngram":  # the head's, from the last step: its grammar may cut them
                request.spec_token_ids = self.structured_outputs.allowed_drafts(
                    request.request_id, request.spec_token_ids
                )
                continue
            count = min(request.backoff.next_count(), request.draft_room)
            if count <= 0:
                request.spec_token_ids = []
                continue
            index = request.draft_index
            if index is None:
                spans = [(item.offset, item.end) for item in request.mm_items]
                index = request.draft_index = NgramIndex(request.prompt_token_ids, spans)
            if index.length < request.num_tokens:
                index.extend(request.token_ids(index.length, request.num_tokens))
            drafts = index.propose(spec.prompt_lookup_min, spec.prompt_lookup_max, count)
            request.spec_token_ids = self.structured_outputs.allowed_drafts(request.request_id, drafts)

    def _queue_compiled(self) -> None:
        """The requests whose grammar compiled, into the scheduler; those refused for it, into
        take_refused()."""
        for request in self.structured_outputs.take_ready():
            try:
                self.scheduler.add_request(request)
            except ValueError as e:  # checked when it came; kept for safety: it fails alone
                self.structured_outputs.remove([request.request_id])
                self.refused[request.request_id] = str(e)
        self.refused.update(self.structured_outputs.take_refused())

    def _fill_grammar_masks(self, step: SchedulerOutput) -> None:
        """The masks of the requests this step samples under a grammar (those whose known tokens
        it computes to the end), into the step: filled once, here, for every rank."""
        if not self.structured_outputs.matchers:
            return
        requests = self.scheduler.requests
        drafts = step.scheduled_spec_tokens
        sampled = []
        for request_id, n in step.num_scheduled_tokens.items():
            request = requests[request_id]
            if request.num_computed_tokens + n - len(drafts.get(request_id, ())) == request.num_tokens:
                sampled.append(request_id)
        step.structured_output_request_ids, step.grammar_bitmask = self.structured_outputs.fill(sampled, drafts)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step. If it raises, the step is undone and its requests run one at a time:
        those that still raise are failed (their KV blocks and encoder outputs freed)."""
        result = self.executor.execute(scheduler_output)
        for request_id, message in result.failed.items():
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
            self.failed[request_id] = message
        return result.output

    def _count_prompt_tokens(self, step: SchedulerOutput) -> None:
        for request_id, n in step.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            computed = request.num_computed_tokens  # advanced only when the step's output comes
            self.num_prompt_tokens += max(0, min(computed + n, request.num_prompt_tokens) - computed)

    def take_refused(self) -> dict[str, str]:
        """Request id -> why, for each request refused for its grammar since the last call: its
        spec does not compile, or passed a limit (it is gone; the request's fault: a 400)."""
        refused, self.refused = self.refused, {}
        return refused

    def take_failed(self) -> dict[str, str]:
        """Request id -> why (for the log), for each request failed by an error in the engine
        since the last call (they are gone)."""
        failed, self.failed = self.failed, {}
        return failed


def check_runner(pooler: PoolerConfig | None, pooling_params: PoolingParams | None) -> None:
    """ValueError for a request of the other runner's kind (vLLM's refusals), or pooling
    parameters this model cannot serve."""
    if pooler is None:
        if pooling_params is not None:
            raise ValueError(
                "this model generates text; pooling (embeddings, scores) needs a pooling model "
                "started with runner='pooling' (--runner pooling)"
            )
        return
    if pooling_params is None:
        raise ValueError(
            f"this model is a pooling model (task {pooler.task!r}) and does not generate text; "
            "start a generation model for that, or ask it for embeddings or scores"
        )
    pooling_params.verify(pooler)
