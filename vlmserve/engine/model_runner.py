"""Runs one scheduled step on the model: prepare -> forward -> sample.

- prepare (engine/step_batch.py): the scheduler's output -> a StepBatch of plain data: token
  ids, positions, slot mapping, block tables, the image rows and their encoder outputs, which
  rows are sampled and which scored for prompt logprobs;
- forward: the model on that batch (a captured CUDA graph for a decode step where there is one);
- sample: the sampler (its greedy CPU path inside), logprobs, prompt logprobs, the tensor-parallel
  share of the tokens, appended to the runner's copy of each request.

Before them the runner takes in what the step says of its requests (engine/request_state.py) and
encodes the images the step needs. A step that raises is undone and rerun request by request by
engine/step_isolation.py; the memory planner's worst-case step is engine/profile_step.py."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from vlmserve.attention.layer import PagedAttention
from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.attention.state import SequenceState
from vlmserve.distributed.control import share_sampled
from vlmserve.engine.cuda_graphs import Capture, DecodeGraphs
from vlmserve.engine.draft_head import propose as draft_head_propose
from vlmserve.engine.pooler import Pooler
from vlmserve.engine.profile_step import profile_worst_step
from vlmserve.engine.prompt_logprobs import finished_buffer
from vlmserve.engine.request_state import CachedRequestState
from vlmserve.engine.sampler import GrammarMask, Sampler, token_logprobs
from vlmserve.engine.speculative import verify_drafts
from vlmserve.engine.step_batch import StepBatch, attention_metadata, prepare
from vlmserve.ipc.contracts import ModelRunnerOutput, SchedulerOutput
from vlmserve.lora.manager import LoRAManager
from vlmserve.lora.request import LoRARequest
from vlmserve.models.base import VLModel, place_multimodal
from vlmserve.multimodal.inputs import MultiModalItem

logger = logging.getLogger(__name__)

# Speculative decoding on a model with per-request state: put a rejected draft's request back to
# the state the layers kept after its last accepted token (1, the default), or to its state from
# before the step, computing the accepted tokens again (0; docs/benchmarks.md measures both).
KEEP_POSITION_STATES = os.environ.get("VLMSERVE_KEEP_POSITION_STATES", "1") != "0"


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
        # Decode steps replayed from CUDA graphs (capture_decode_graphs); None: every step eager.
        self.decode_graphs: DecodeGraphs | None = None
        # The step's saved per-request state of requests verifying drafts (slots, per state
        # layer its tensors' rows), until its drafts are checked (_save_states).
        self._saved_states: tuple[list[int], list[list[torch.Tensor]]] | None = None
        # LoRA adapters (the engine's enable_lora): the adapters held and each step's rows of each.
        self.lora: LoRAManager | None = None
        # The pooling runner's (runner="pooling"): what a pooling request's last hidden state becomes.
        self.pooler: Pooler | None = None

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

    def bind_caches(self, num_blocks: int, block_size: int, group_slots: list[int]) -> None:
        """The paged KV of the attention layers, and the slot group of the state layers (its
        slots; the one slot group a model may have)."""
        assert len(group_slots) == bool(self.state_layers), (group_slots, len(self.state_layers))
        self.bind_kv_cache(num_blocks, block_size)
        if group_slots:
            self.bind_state_cache(group_slots[0])

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

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """The token sampled for each request that reached the end of its known tokens (appended
        to the runner's copy of the request too), and their log-probabilities where asked for."""
        assert self.block_size, "bind_kv_cache() before the first step"
        self._update_requests(step)
        self._encode(step)
        if not step.num_scheduled_tokens:
            return ModelRunnerOutput()
        draft_head = self.model.has_draft_head
        batch = prepare(
            step,
            self.requests,
            self.encoder_cache,
            self.block_size,
            self.model.decode_positions,
            self.model.prunes_output_rows and not draft_head,  # the head reads every row
        )
        hidden = self.forward(batch, step)
        out = self.sample(batch, hidden, step)
        if draft_head:
            draft_head_propose(self.model, batch, hidden, step, out, self.block_size, self.device)
        return out

    def _update_requests(self, step: SchedulerOutput) -> None:
        for request_id in step.finished_req_ids:
            self.requests.pop(request_id, None)
        for new in step.scheduled_new_reqs:
            self.requests[new.request_id] = CachedRequestState.from_new(new)
        for cached in step.scheduled_cached_reqs:
            self.requests[cached.request_id].update(cached)

    def _encode(self, step: SchedulerOutput) -> None:
        """The images and videos the step needs that no step encoded yet, into the encoder cache."""
        self.free_encoder_outputs(step.free_encoder_hashes)
        items = [
            self.requests[request_id].mm_items[i]
            for request_id, indexes in step.scheduled_encoder_inputs.items()
            for i in indexes
        ]
        if not items:
            return
        if self.lora is None:
            for item, embeds in zip(items, self.model.embed_multimodal(items), strict=True):
                self.encoder_cache[item.content_hash] = embeds
            return
        # With adapters: the items of each adapter that changes the vision tower encoded together
        # under it (their content hashes carry the adapter: engine/request.py), the rest under none.
        groups: dict[LoRARequest | None, list[MultiModalItem]] = {}
        for request_id, indexes in step.scheduled_encoder_inputs.items():
            state = self.requests[request_id]
            lora = state.lora_request
            group = lora if lora is not None and self.lora.get(lora).vision else None
            groups.setdefault(group, []).extend(state.mm_items[i] for i in indexes)
        for lora, mine in groups.items():
            with self.lora.encoding(lora):
                for item, embeds in zip(mine, self.model.embed_multimodal(mine), strict=True):
                    self.encoder_cache[item.content_hash] = embeds

    def forward(self, batch: StepBatch, step: SchedulerOutput) -> torch.Tensor:
        """The model on the batch -> hidden states of batch.output_rows (every row where None),
        [rows, hidden_size]. The state copies the step asks for go before and after it."""
        graphs = self.decode_graphs
        loras = [s.lora_request for s in batch.scheduled] if self.lora is not None else []
        if any(loras):
            graphs = None  # the captured graphs hold the base model's layers alone
        rows = batch.decode_rows() if graphs is not None and graphs.bucket(batch.num_tokens) else None
        if graphs is not None and rows is not None:
            # A decode step, or a verify step's tokens as decode rows (each over its own prefix: in
            # each layer every row's K/V is written before any row attends).
            hidden = graphs.run(batch.token_ids, batch.positions, batch.slot_mapping, *rows)
            return hidden if batch.output_rows is None else hidden[batch.output_rows]
        meta = self._metadata(batch)
        if self.state_layers and KEEP_POSITION_STATES:
            verifying = {state.request_id for state, drafts in zip(batch.sampled, batch.drafts, strict=True) if drafts}
            if verifying:
                meta = replace(meta, keep_position_states=[s.request_id in verifying for s in batch.scheduled])
        if batch.output_rows is not None:
            meta = replace(meta, output_rows=torch.tensor(batch.output_rows, dtype=torch.long, device=self.device))
        input_ids = torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)
        inputs_embeds, layer_extras = place_multimodal(self.model.get_input_embeddings(input_ids), batch.mm_spans)
        self._copy_states(step.copies_before_forward)
        self._save_states(batch)
        positions = batch.positions.to(self.device)
        if any(loras):
            assert self.lora is not None
            with self.lora.step(loras, _row_counts(batch), batch.output_rows):
                hidden = self.model(None, positions, meta, inputs_embeds, layer_extras)
        else:
            hidden = self.model(None, positions, meta, inputs_embeds, layer_extras)
        self._copy_states(step.copies_after_forward)
        return hidden

    def sample(self, batch: StepBatch, hidden: torch.Tensor, step: SchedulerOutput) -> ModelRunnerOutput:
        """Prompt logprobs of the step's prompt rows, then a token for each sampled request (every
        rank appends rank 0's), its logprobs where asked for. A request verifying drafts is
        sampled at each of its rows, as if the drafts before the row were its tokens: its drafts
        are accepted while each equals the sample before it, and the first sample that differs
        (or the one after the last draft) is its next token (engine/speculative.py)."""
        batch.prompt_rows.compute(hidden, batch.hidden_rows(batch.prompt_rows.rows), self.model.compute_logits)
        out = ModelRunnerOutput()
        if any(state.pooling_params is not None for state in batch.sampled):
            batch = self._pool(batch, hidden, out)
        sampled = batch.sampled
        if not sampled:
            self._saved_states = None
            return out
        logits = self.model.compute_logits(hidden[batch.hidden_rows(batch.sample_rows)])
        pairs = zip(sampled, batch.drafts, strict=True)
        rows = [(state, drafts[:j]) for state, drafts in pairs for j in range(len(drafts) + 1)]
        params = [state.params for state, _ in rows]
        generators = [state.generator for state, _ in rows]
        histories = [state.history(before) for state, before in rows]
        tokens = self.sampler(logits, params, generators, histories, _grammar_of(step, sampled, batch.drafts))
        # Tensor parallel: every rank appends rank 0's tokens (identity in one process).
        tokens = share_sampled([state.request_id for state, _ in rows], tokens)
        counts = [state.params.logprobs for state, _ in rows]
        info = token_logprobs(logits, tokens, counts) if any(c is not None for c in counts) else None
        rejected: list[CachedRequestState] = []
        row = 0
        for state, drafts, kept in zip(sampled, batch.drafts, verify_drafts(tokens, batch.drafts), strict=True):
            accepted = len(kept) - 1
            out.sampled_token_ids[state.request_id] = kept
            if info is not None and info[row] is not None:
                out.logprobs[state.request_id] = [x for x in info[row : row + accepted + 1] if x is not None]
            if state.samples_prompt_logprobs:
                assert state.prompt_logprobs is not None
                out.prompt_logprobs[state.request_id] = finished_buffer(state.prompt_logprobs)
            if accepted < len(drafts):
                rejected.append(state)
            state.token_ids.extend(kept)
            row += len(drafts) + 1
        self._restore_states(rejected, batch, out)
        return out

    def _pool(self, batch: StepBatch, hidden: torch.Tensor, out: ModelRunnerOutput) -> StepBatch:
        """The pooling requests whose prompt the step finished: their last row pooled into
        out.pooled. -> the batch with only the requests to sample (a pooling request verifies no
        drafts: one row each)."""
        assert self.pooler is not None, "a pooling request on a runner without a pooler"
        pooled, pooled_rows, keep, kept_rows = [], [], [], []
        row = 0
        for i, (state, drafts) in enumerate(zip(batch.sampled, batch.drafts, strict=True)):
            count = len(drafts) + 1
            if state.pooling_params is not None:
                pooled.append(state)
                pooled_rows.append(batch.sample_rows[row])
            else:
                keep.append(i)
                kept_rows += batch.sample_rows[row : row + count]
            row += count
        vectors = self.pooler(hidden[batch.hidden_rows(pooled_rows)], [s.pooling_params for s in pooled])  # type: ignore[misc]
        for state, vector in zip(pooled, vectors, strict=True):
            out.pooled[state.request_id] = vector
        return replace(
            batch,
            sampled=[batch.sampled[i] for i in keep],
            sample_rows=kept_rows,
            drafts=[batch.drafts[i] for i in keep],
        )

    def _save_states(self, batch: StepBatch) -> None:
        """Before the forward: the per-request state (conv windows, recurrent states) of the
        requests verifying drafts, which a rejected draft leaves wrong (it cannot be undone: the
        state after the accepted tokens is not kept)."""
        self._saved_states = None
        if not self.state_layers:
            return
        spec = [state.state_slot for state, drafts in zip(batch.sampled, batch.drafts, strict=True) if drafts]
        if not spec:
            return
        index = torch.tensor(spec, dtype=torch.long, device=self.device)
        saved = [[state.index_select(0, index) for state in layer.states] for layer in self.state_layers]
        self._saved_states = (spec, saved)

    def _restore_states(self, rejected: list[CachedRequestState], batch: StepBatch, out: ModelRunnerOutput) -> None:
        """The per-request state of the requests that rejected a draft, as it was after their last
        accepted token: from the states the layers kept after each token of the step (the
        recurrent form's, SequenceState.position_states), or where they did not keep them (a
        sequence the chunked form ran), the saved state from before the step: then none of the
        step's tokens stays computed, and the scheduler has them computed again (with the
        accepted drafts and the new token, in one step as long as a verify step is)."""
        saved, self._saved_states = self._saved_states, None
        if not rejected or not self.state_layers:
            return
        rows = dict(zip((s.request_id for s in batch.scheduled), _row_counts(batch), strict=True))
        put_back = []
        for request in rejected:
            slot = request.state_slot
            if not all(slot in layer.position_states for layer in self.state_layers):
                put_back.append(request)
                continue
            # the row of its last accepted token: its known tokens' last, then one per accepted draft
            drafts = batch.drafts[batch.sampled.index(request)]
            accepted = len(out.sampled_token_ids[request.request_id]) - 1
            row = rows[request.request_id] - len(drafts) - 1 + accepted
            for layer in self.state_layers:
                for tensor, kept in zip(layer.states, layer.position_states[slot], strict=True):
                    tensor[slot].copy_(kept[row])
        if not put_back:
            return
        assert saved is not None, "a state saved before the step for each request verifying drafts"
        slots, tensors = saved
        index = torch.tensor([slots.index(r.state_slot) for r in put_back], dtype=torch.long, device=self.device)
        dst = torch.tensor([r.state_slot for r in put_back], dtype=torch.long, device=self.device)
        for layer, layer_saved in zip(self.state_layers, tensors, strict=True):
            for tensor, copy in zip(layer.states, layer_saved, strict=True):
                tensor.index_copy_(0, dst, copy.index_select(0, index))
        for request in put_back:
            out.num_kept_tokens[request.request_id] = 0

    def _copy_states(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy per-request state from slot to slot in every SequenceState layer (the slot group,
        group 0: (group, from, to))."""
        if copies:
            assert all(group == 0 for group, _, _ in copies), copies
            src = torch.tensor([a for _, a, _ in copies], dtype=torch.long, device=self.device)
            dst = torch.tensor([b for _, _, b in copies], dtype=torch.long, device=self.device)
            for layer in self.state_layers:
                for state in layer.states:
                    state.index_copy_(0, dst, state.index_select(0, src))

    def _metadata(self, batch: StepBatch) -> AttentionMetadata:
        state_slots = has_initial_state = None
        if self.state_layers:
            state_slots = [s.state_slot for s in batch.scheduled]
            has_initial_state = [s.num_computed_tokens > 0 for s in batch.scheduled]
        return attention_metadata(
            batch.slot_mapping,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_tables,
            self.block_size,
            self.device,
            state_slots,
            has_initial_state,
        )

    # -- the memory planner's worst case --------------------------------------------------------

    def profile_run(
        self, dummy_items: list[MultiModalItem], num_tokens: int, max_model_len: int, num_seqs: int, block_size: int
    ) -> int:
        """Peak activation bytes of the worst step the limits admit (engine/profile_step.py)."""
        return profile_worst_step(self, dummy_items, num_tokens, max_model_len, num_seqs, block_size)


def _grammar_of(
    step: SchedulerOutput, sampled: list[CachedRequestState], drafts: list[list[int]]
) -> GrammarMask | None:
    """The step's grammar masks (filled once, by the engine core) as the sampled rows: a request's
    1 + drafts rows take its consecutive rows of the bitmask (each after the drafts before it)."""
    bitmask = step.grammar_bitmask
    if bitmask is None or not step.structured_output_request_ids:
        return None
    first: dict[str, int] = {}
    for i, request_id in enumerate(step.structured_output_request_ids):
        first.setdefault(request_id, i)
    picks: list[tuple[int, int]] = []  # (sampled row, bitmask row)
    row = 0
    for state, mine in zip(sampled, drafts, strict=True):
        base = first.get(state.request_id)
        if base is not None:
            picks += [(row + j, base + j) for j in range(len(mine) + 1)]
        row += len(mine) + 1
    if not picks:
        return None
    masks = torch.full((row, bitmask.shape[1]), -1, dtype=torch.int32)
    masks[[a for a, _ in picks]] = bitmask[[b for _, b in picks]]
    return GrammarMask(masks, [a for a, _ in picks])


def _row_counts(batch: StepBatch) -> list[int]:
    """Each scheduled sequence's rows in the batch."""
    loc = batch.query_start_loc
    return [loc[i + 1] - loc[i] for i in range(len(batch.scheduled))]
