"""Runs one scheduled step: keeps what it needs of each request (CachedRequestState, filled from
the SchedulerOutput's plain data), encodes the images the step needs, builds the flat batch and
its attention metadata, runs the model and samples the requests whose known tokens are all
computed. Also runs the memory planner's worst-case profile step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from vlmserve.attention.layer import PagedAttention
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.attention.state import SequenceState
from vlmserve.distributed.control import share_sampled
from vlmserve.engine.contracts import ModelRunnerOutput, NewRequestData, SchedulerOutput, TokenLogprobs
from vlmserve.engine.cuda_graphs import Capture, DecodeGraphs
from vlmserve.engine.memory import PeakMeter, one_block_per_stack
from vlmserve.engine.prompt_logprobs import PromptLogprobsRows, finished_buffer, new_buffer
from vlmserve.engine.sampler import GrammarMask, Sampler, TokenHistory, token_logprobs
from vlmserve.engine.structured_output import GrammarCompiler, GrammarState, TokenBitmask
from vlmserve.models.base import VLModel, item_rows, place_multimodal
from vlmserve.multimodal.inputs import MultiModalItem
from vlmserve.progress import progress
from vlmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# (start, end, mrope_delta, num_prompt_tokens) -> [3, end - start] positions
DecodePositions = Callable[[int, int, int, int], torch.Tensor]


@dataclass
class CachedRequestState:
    """The runner's own copy of a request, from its NewRequestData on; it lives until the request
    finishes (across preemptions, so a seeded generator continues where it was)."""

    request_id: str
    token_ids: list[int]  # prompt, then every token sampled for it
    num_prompt_tokens: int
    mm_items: list[MultiModalItem]
    mrope_positions: torch.Tensor | None  # [3, num_prompt_tokens]
    mrope_delta: int
    params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    all_stop_token_ids: list[int]
    state_slot: int = -1  # its per-request state (SequenceState layers); -1: the model has none
    # Structured outputs: the matcher that has taken this request's output tokens (made at its
    # first sample; rebuilt from the output wherever the two disagree).
    grammar: GrammarState | None = None
    # Prompt logprobs, one entry per prompt token after the first, filled chunk by chunk (None:
    # not asked for).
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @classmethod
    def from_new(cls, new: NewRequestData) -> CachedRequestState:
        seed = new.sampling_params.seed
        return cls(
            request_id=new.request_id,
            token_ids=list(new.prompt_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            mm_items=new.mm_items,
            mrope_positions=new.mrope_positions,
            mrope_delta=new.mrope_delta,
            params=new.sampling_params,
            generator=None if seed is None else torch.Generator().manual_seed(seed),
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            all_stop_token_ids=list(new.all_stop_token_ids),
            state_slot=new.state_slot,
            prompt_logprobs=None
            if new.sampling_params.prompt_logprobs is None
            else new_buffer(len(new.prompt_token_ids)),
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def history(self) -> TokenHistory:
        return TokenHistory(self.token_ids, self.num_prompt_tokens, self.all_stop_token_ids)

    def positions(self, start: int, end: int, decode_positions: DecodePositions) -> torch.Tensor:
        """[3, end - start] positions of tokens [start, end): the prompt's own, then the model's
        rule for generated tokens (VLModel.decode_positions)."""
        p = self.num_prompt_tokens
        pieces = []
        if start < p and self.mrope_positions is not None:
            pieces.append(self.mrope_positions[:, start : min(end, p)])
            start = min(end, p)
        if start < end:
            # A prompt without precomputed positions starts the rule at position 0.
            delta = self.mrope_delta if self.mrope_positions is not None else 0
            pieces.append(decode_positions(start, end, delta, p))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)


@dataclass
class _RequestSnapshot:
    """What a step changes of a request the runner already holds, to undo a failed step."""

    block_ids: list[int]
    num_computed_tokens: int
    num_token_ids: int
    generator_state: torch.Tensor | None


# Per scheduled request, its state before the step; None: the step brings it new.
StepSnapshot = dict[str, _RequestSnapshot | None]


class ModelRunner:
    def __init__(self, model: VLModel, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler()
        self.block_size = 0  # set by bind_kv_cache
        self.requests: dict[str, CachedRequestState] = {}
        # Encoder outputs by content hash; the scheduler says when each may go.
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.attention_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        # Layers with per-request state of fixed size (linear attention); none for most models.
        self.state_layers = [m for m in model.modules() if isinstance(m, SequenceState)]
        # Structured outputs (set by the engine core); the bitmask is sized by the model's logits.
        self.grammars: GrammarCompiler | None = None
        self.token_bitmask: TokenBitmask | None = None
        # Decode steps replayed from CUDA graphs (capture_decode_graphs); None: every step eager.
        self.decode_graphs: DecodeGraphs | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        per_layer = [2 * m.num_kv_heads * m.head_dim for m in self.attention_layers]
        return sum(per_layer) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def state_bytes_per_slot(self) -> int:
        """One request's state in all SequenceState layers (0 for a model without any)."""
        return sum(layer.slot_bytes(self.dtype) for layer in self.state_layers)

    @torch.inference_mode()
    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: Capture) -> None:
        """Called once the KV cache is bound with one block past the scheduler's: the scratch
        block padded decode rows write to (engine/cuda_graphs.py)."""
        assert self.attention_layers and self.attention_layers[0].kv_cache is not None, "bind the KV cache first"
        scratch_block = self.attention_layers[0].kv_cache.shape[1] - 1
        max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.decode_graphs = DecodeGraphs(
            self.model, self.device, max_num_seqs, max_blocks_per_seq, self.block_size, scratch_block, capture
        )

    def bind_state_cache(self, num_slots: int) -> None:
        for layer in self.state_layers:
            layer.bind(num_slots, self.dtype, self.device)

    def bind_kv_cache(self, num_blocks: int, block_size: int, layers: list[PagedAttention] | None = None) -> None:
        self.block_size = block_size
        for layer in self.attention_layers if layers is None else layers:
            # Zeroed so padded reads in batched decode see finite values (masked away anyway).
            layer.kv_cache = torch.zeros(
                2, num_blocks, block_size, layer.num_kv_heads, layer.head_dim, dtype=self.dtype, device=self.device
            )

    def free_encoder_outputs(self, content_hashes: list[str]) -> None:
        for content_hash in content_hashes:
            self.encoder_cache.pop(content_hash, None)

    def reset(self) -> None:
        """Forget every request and encoder output (the scheduler's reset, after an error)."""
        self.requests.clear()
        self.encoder_cache.clear()

    # -- a step ---------------------------------------------------------------------------------

    def _update_states(self, step: SchedulerOutput) -> None:
        for request_id in step.finished_req_ids:
            self.requests.pop(request_id, None)
        for new in step.scheduled_new_reqs:
            self.requests[new.request_id] = CachedRequestState.from_new(new)
        for cached in step.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            state.state_slot = cached.state_slot

    def _slot(self, state: CachedRequestState, token_index: int) -> int:
        return state.block_ids[token_index // self.block_size] * self.block_size + token_index % self.block_size

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """The token sampled for each request that reached the end of its known tokens (appended
        to the runner's copy of the request too), and their log-probabilities where asked for."""
        assert self.block_size, "bind_kv_cache() before the first step"
        self._update_states(step)
        self.free_encoder_outputs(step.free_encoder_hashes)
        if step.scheduled_encoder_inputs:
            items = [
                self.requests[request_id].mm_items[i]
                for request_id, indexes in step.scheduled_encoder_inputs.items()
                for i in indexes
            ]
            for item, embeds in zip(items, self.model.embed_multimodal(items), strict=True):
                self.encoder_cache[item.content_hash] = embeds
        if not step.num_scheduled_tokens:
            return ModelRunnerOutput()

        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        block_rows: list[list[int]] = []
        mm_spans: list[tuple[int, torch.Tensor]] = []  # (row in the batch, embeddings to place there)
        sample_rows: list[int] = []
        sampled: list[CachedRequestState] = []
        scheduled: list[CachedRequestState] = []
        prompt_rows = PromptLogprobsRows()
        for request_id, n in step.num_scheduled_tokens.items():
            state = self.requests[request_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            assert end <= len(state.token_ids), (
                f"{request_id}: tokens up to {end} scheduled, {len(state.token_ids)} known"
            )
            base = len(token_ids)
            token_ids.extend(state.token_ids[start:end])
            positions.append(state.positions(start, end, self.model.decode_positions))
            slots.extend(self._slot(state, t) for t in range(start, end))
            for item in state.mm_items:
                lo, hi = max(start, item.offset), min(end, item.end)
                if lo < hi:
                    embeds = self.encoder_cache[item.content_hash]
                    mm_spans.append((base + lo - start, item_rows(embeds, lo - item.offset, hi - item.offset)))
            query_start_loc.append(len(token_ids))
            seq_lens.append(end)
            block_rows.append(state.block_ids)
            scheduled.append(state)
            count = state.params.prompt_logprobs
            # Until the first token is sampled (after that, a recompute after preemption has them).
            if (
                state.prompt_logprobs is not None
                and count is not None
                and len(state.token_ids) == state.num_prompt_tokens
            ):
                prompt_rows.add(state.prompt_logprobs, state.token_ids, start, end, base, count)
            if end == len(state.token_ids):  # every known token computed: sample the next one
                sample_rows.append(len(token_ids) - 1)
                sampled.append(state)

        state_slots = has_initial_state = None
        if self.state_layers:
            state_slots = [s.state_slot for s in scheduled]
            has_initial_state = [s.num_computed_tokens > 0 for s in scheduled]
        graphs = self.decode_graphs
        if graphs is not None and len(token_ids) == len(scheduled) and not mm_spans and graphs.bucket(len(token_ids)):
            # A decode step (one token per request, no image rows): replay a captured graph.
            hidden = graphs.run(token_ids, torch.cat(positions, dim=1), slots, seq_lens, block_rows)
        else:
            output_rows = self._output_rows(len(token_ids), sample_rows, prompt_rows)
            meta = self._metadata(
                slots, query_start_loc, seq_lens, block_rows, self.block_size, state_slots, has_initial_state
            )
            if output_rows is not None:
                meta = replace(meta, output_rows=torch.tensor(output_rows, dtype=torch.long, device=self.device))
                # the hidden states come back for these rows only: the rows are renumbered
                place = {row: i for i, row in enumerate(output_rows)}
                sample_rows = [place[r] for r in sample_rows]
                prompt_rows.rows = [place[r] for r in prompt_rows.rows]
            input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
            inputs_embeds, layer_extras = place_multimodal(self.model.get_input_embeddings(input_ids), mm_spans)
            self._copy_states(step.load_states)
            hidden = self.model(None, torch.cat(positions, dim=1).to(self.device), meta, inputs_embeds, layer_extras)
            self._copy_states(step.save_states)
        prompt_rows.compute(hidden, self.model.compute_logits)
        if not sampled:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[sample_rows])
        grammar_states = self._grammar_states(sampled)
        grammar = None
        if any(g is not None for g in grammar_states):
            if self.token_bitmask is None:
                self.token_bitmask = TokenBitmask(logits.shape[-1])
            grammar = GrammarMask(*self.token_bitmask.fill(grammar_states))
        params = [s.params for s in sampled]
        generators, histories = [s.generator for s in sampled], [s.history() for s in sampled]
        tokens = self.sampler(logits, params, generators, histories, grammar)
        # Tensor parallel: every rank appends rank 0's tokens (identity in one process).
        tokens = share_sampled([s.request_id for s in sampled], tokens)
        out = ModelRunnerOutput(sampled_token_ids={s.request_id: t for s, t in zip(sampled, tokens, strict=True)})
        counts = [s.params.logprobs for s in sampled]
        if any(c is not None for c in counts):
            info = token_logprobs(logits, tokens, counts)
            out.logprobs = {s.request_id: x for s, x in zip(sampled, info, strict=True) if x is not None}
        for state in sampled:
            if state.prompt_logprobs is not None and len(state.token_ids) == state.num_prompt_tokens:
                out.prompt_logprobs[state.request_id] = finished_buffer(state.prompt_logprobs)
        for state, token in zip(sampled, tokens, strict=True):
            state.token_ids.append(token)
            if state.grammar is not None:
                state.grammar.accept(token)
        return out

    def _grammar_states(self, sampled: list[CachedRequestState]) -> list[GrammarState | None]:
        """Each sampled request's matcher, in step with its output (made or rebuilt here)."""
        states: list[GrammarState | None] = []
        for state in sampled:
            spec = state.params.structured_outputs
            if spec is None:
                states.append(None)
                continue
            output = state.output_token_ids
            if state.grammar is None or state.grammar.num_accepted != len(output):
                assert self.grammars is not None, "structured outputs without a grammar compiler"
                state.grammar = self.grammars.matcher(spec, output)
            states.append(state.grammar)
        return states

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy per-request state from slot to slot in every SequenceState layer."""
        if pairs:
            src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=self.device)
            dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=self.device)
            for layer in self.state_layers:
                for state in layer.states:
                    state.index_copy_(0, dst, state.index_select(0, src))

    def _output_rows(
        self, num_tokens: int, sample_rows: list[int], prompt_rows: PromptLogprobsRows
    ) -> list[int] | None:
        """The rows whose hidden states this step uses, ascending, where that is fewer than all and
        the model can skip the others in its last layer; else None. A step that uses none (a
        prompt's middle chunk) keeps its last row: no product runs on zero rows."""
        if not self.model.prunes_output_rows:
            return None
        rows = sorted(set(sample_rows).union(prompt_rows.rows)) or [num_tokens - 1]
        return rows if len(rows) < num_tokens else None

    def _metadata(
        self,
        slots: list[int],
        query_start_loc: list[int],
        seq_lens: list[int],
        block_rows: list[list[int]],
        block_size: int,
        state_slots: list[int] | None = None,
        has_initial_state: list[bool] | None = None,
    ) -> AttentionMetadata:
        width = max(len(row) for row in block_rows)
        block_tables = torch.zeros(len(block_rows), width, dtype=torch.long)
        for i, row in enumerate(block_rows):
            block_tables[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            block_tables=block_tables.to(self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=self.device),
            query_start_loc=query_start_loc,
            seq_lens_host=seq_lens,
            block_size=block_size,
            state_slots=None
            if state_slots is None
            else torch.tensor(state_slots, dtype=torch.long, device=self.device),
            state_slots_host=state_slots,
            has_initial_state=has_initial_state,
        )

    # -- a step that failed --------------------------------------------------------------------

    def snapshot(self, step: SchedulerOutput) -> StepSnapshot:
        """What `execute(step)` may change of the requests it runs, taken before it runs."""
        snapshot: StepSnapshot = {}
        for request_id in step.num_scheduled_tokens:
            state = self.requests.get(request_id)
            if state is None:
                snapshot[request_id] = None
                continue
            generator = state.generator
            snapshot[request_id] = _RequestSnapshot(
                list(state.block_ids),
                state.num_computed_tokens,
                len(state.token_ids),
                None if generator is None else generator.get_state(),
            )
        return snapshot

    def execute_one_at_a_time(
        self, step: SchedulerOutput, snapshot: StepSnapshot
    ) -> tuple[ModelRunnerOutput, dict[str, str]]:
        """After `execute(step)` raised: undo what it did, then run its requests one at a time.
        Returns the output of those that ran, and request id -> why for those that raised again
        (forgotten here; the caller frees them in the scheduler)."""
        # Undo what the failed step did: new requests forgotten, the others as before.
        for request_id, saved in snapshot.items():
            if saved is None:
                self.requests.pop(request_id, None)
                continue
            state = self.requests[request_id]
            state.block_ids = list(saved.block_ids)
            state.num_computed_tokens = saved.num_computed_tokens
            del state.token_ids[saved.num_token_ids :]
            if state.generator is not None and saved.generator_state is not None:
                state.generator.set_state(saved.generator_state)
        for request_id in step.finished_req_ids:
            self.requests.pop(request_id, None)
        self.free_encoder_outputs(step.free_encoder_hashes)
        if self.state_layers:
            # The failed step may have updated some of its requests' recurrent states in place,
            # and they cannot be undone (a copy of every scheduled slot before every step would
            # cost megabytes per request per layer). Running them again would apply those tokens
            # twice, so every request of the step fails.
            for request_id in step.num_scheduled_tokens:
                self.requests.pop(request_id, None)
            why = "the engine failed a step holding this request (its per-request state cannot be rolled back)"
            return ModelRunnerOutput(), dict.fromkeys(step.num_scheduled_tokens, why)

        new = {data.request_id: data for data in step.scheduled_new_reqs}
        cached = {data.request_id: data for data in step.scheduled_cached_reqs}
        merged = ModelRunnerOutput()
        failed: dict[str, str] = {}
        for request_id, n in step.num_scheduled_tokens.items():
            one = SchedulerOutput(num_scheduled_tokens={request_id: n})
            if request_id in new:
                one.scheduled_new_reqs = [new[request_id]]
                items, start = new[request_id].mm_items, new[request_id].num_computed_tokens
            else:
                one.scheduled_cached_reqs = [cached[request_id]]
                items, start = self.requests[request_id].mm_items, cached[request_id].num_computed_tokens
            # Every image this chunk reads whose encoder output is missing (its encoding may have
            # been another request's, or part of the batch that failed).
            missing = [
                i
                for i, item in enumerate(items)
                if item.offset < start + n and item.end > start and item.content_hash not in self.encoder_cache
            ]
            if missing:
                one.scheduled_encoder_inputs = {request_id: missing}
            try:
                result = self.execute(one)
            except Exception as e:
                logger.exception("request %s failed", request_id)
                self.requests.pop(request_id, None)
                failed[request_id] = f"the engine failed computing this request ({type(e).__name__})"
                continue
            merged.sampled_token_ids.update(result.sampled_token_ids)
            merged.logprobs.update(result.logprobs)
            merged.prompt_logprobs.update(result.prompt_logprobs)
        return merged, failed

    # -- the memory planner's worst case --------------------------------------------------------

    @torch.inference_mode()
    def profile_run(
        self, dummy_items: list[MultiModalItem], num_tokens: int, max_model_len: int, num_seqs: int, block_size: int
    ) -> int:
        """Peak activation bytes of the worst step the limits admit: encode `dummy_items`, compute
        `num_tokens` new tokens at the end of a max_model_len context, decode `num_seqs` sequences
        of max_model_len, and sample `num_seqs` rows. Uses a scratch KV cache of max_model_len
        tokens (not counted)."""
        num_blocks = -(-max_model_len // block_size)
        blocks = list(range(num_blocks))
        hidden_size = self.model.get_input_embeddings(torch.zeros(1, dtype=torch.long, device=self.device)).shape[-1]
        greedy_and_sampled = [
            SamplingParams(temperature=0.0),
            # Every stage of the sampler, penalties over a full-length history included.
            SamplingParams(
                temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.5
            ),
        ]
        meter = PeakMeter(self.device)
        # Three parts: the largest images through the encoder, a prompt chunk, a full decode batch.
        parts = progress(desc="profiling memory (worst-case step)", total=3, unit="part", logger=logger)
        with parts, one_block_per_stack(self.model):
            self.bind_kv_cache(
                num_blocks, block_size, [m for m in self.model.modules() if isinstance(m, PagedAttention)]
            )
            # Scratch states, one slot per sequence (their bytes are planned apart, not measured here).
            state_layers = [m for m in self.model.modules() if isinstance(m, SequenceState)]
            for state_layer in state_layers:
                state_layer.bind(num_seqs, self.dtype, self.device)
            stateful = bool(state_layers)
            meter.reset()  # first: it gives free heap pages back, which lowers the current RSS
            baseline = meter.current()
            if dummy_items:
                self.model.embed_multimodal(dummy_items)
            parts.update()
            # A prompt chunk at the end of the longest context.
            q = min(num_tokens, max_model_len)
            meta = self._metadata(
                list(range(max_model_len - q, max_model_len)),
                [0, q],
                [max_model_len],
                [blocks],
                block_size,
                [0] if stateful else None,
                [True] if stateful else None,
            )
            embeds = torch.randn(q, hidden_size, dtype=self.dtype, device=self.device)
            positions = torch.arange(max_model_len - q, max_model_len, device=self.device).expand(3, -1)
            hidden = self.model(None, positions, meta, embeds)
            rows = min(num_seqs, q)
            self._profile_sample(hidden[-rows:], rows, greedy_and_sampled, max_model_len)
            del hidden, embeds
            parts.update()
            # Every sequence decoding at full length (block tables may alias: reads only).
            meta = self._metadata(
                [max_model_len - 1] * num_seqs,
                list(range(num_seqs + 1)),
                [max_model_len] * num_seqs,
                [blocks] * num_seqs,
                block_size,
                list(range(num_seqs)) if stateful else None,
                [True] * num_seqs if stateful else None,
            )
            embeds = torch.randn(num_seqs, hidden_size, dtype=self.dtype, device=self.device)
            positions = torch.full((3, num_seqs), max_model_len - 1, device=self.device)
            hidden = self.model(None, positions, meta, embeds)
            self._profile_sample(hidden, num_seqs, greedy_and_sampled, max_model_len)
            del hidden, embeds
            parts.update()
        peak = meter.peak()
        for layer in self.attention_layers:
            layer.kv_cache = None
        for state_layer in self.state_layers:
            state_layer.states = []
        self.block_size = 0
        return max(0, peak - baseline)

    def _profile_sample(self, hidden: torch.Tensor, rows: int, kinds: list[SamplingParams], max_model_len: int) -> None:
        logits = self.model.compute_logits(hidden).float()
        params = [kinds[i % len(kinds)] for i in range(rows)]
        # Half prompt, half output, at full length (one list shared: the sampler only reads it).
        history = TokenHistory([0] * max_model_len, max_model_len // 2)
        self.sampler(logits, params, [None] * rows, [history] * rows)
