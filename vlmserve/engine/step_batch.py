"""A step's batch as plain data: what the model runner's prepare() makes of the scheduler's output
before the forward, and what the forward and the sampler read from it.

The scheduled requests' new tokens lie end to end: request i's are rows [query_start_loc[i],
query_start_loc[i + 1]), the last of its seq_lens[i] tokens, their K/V written at their slots
(block_ids[t // block_size] * block_size + t % block_size). A request whose known tokens are all
computed by this step is sampled from its last row; one verifying drafted tokens (speculative
decoding) has them after its known tokens and is sampled from its last 1 + drafts rows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from vlmserve.attention.metadata import AttentionMetadata, decode_row_lens
from vlmserve.engine.prompt_logprobs import PromptLogprobsRows
from vlmserve.engine.request_state import CachedRequestState, DecodePositions
from vlmserve.ipc.contracts import SchedulerOutput
from vlmserve.models.base import item_rows


@dataclass
class StepBatch:
    token_ids: list[int]  # [num_tokens]
    positions: torch.Tensor  # [3, num_tokens] int64 (the host's; moved to the device by the forward)
    slot_mapping: list[int]  # [num_tokens]
    query_start_loc: list[int]  # [num_seqs + 1]
    seq_lens: list[int]  # [num_seqs]
    block_tables: list[list[int]]  # [num_seqs][its blocks]
    # (row in the batch, embeddings to place there): the images' and videos' rows of this step
    mm_spans: list[tuple[int, torch.Tensor]]
    scheduled: list[CachedRequestState]  # [num_seqs], in batch order
    sampled: list[CachedRequestState]  # the requests sampled this step
    sample_rows: list[int]  # the rows they are sampled from: 1 + len(drafts[i]) for sampled[i], in order
    drafts: list[list[int]] = field(default_factory=list)  # per sampled request, the drafts it verifies
    prompt_rows: PromptLogprobsRows = field(default_factory=PromptLogprobsRows)
    # The rows whose hidden states this step uses, ascending, where that is fewer than all and the
    # model skips the others in its last layer (prepare decides); None: every row.
    output_rows: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def decode_rows(self) -> tuple[list[int], list[list[int]]] | None:
        """The step as decode rows, a CUDA graph's shape: one token per request, or a few after
        cached ones (a verify step's token and drafts), each token a row over its own prefix
        sharing its sequence's block table (decode_row_lens); no image rows. (each row's length,
        each row's blocks); None where the step has another shape."""
        if self.mm_spans:
            return None
        lens: list[int] = []
        blocks: list[list[int]] = []
        for i, seq_len in enumerate(self.seq_lens):
            count = self.query_start_loc[i + 1] - self.query_start_loc[i]
            rows = [seq_len] if count == 1 else decode_row_lens(count, seq_len)
            if rows is None:
                return None
            lens += rows
            blocks += [self.block_tables[i]] * count
        return lens, blocks

    def hidden_rows(self, rows: list[int]) -> list[int]:
        """Where rows of the batch are in the forward's output (only output_rows come back)."""
        if self.output_rows is None:
            return rows
        place = {row: i for i, row in enumerate(self.output_rows)}
        return [place[row] for row in rows]


def prepare(
    step: SchedulerOutput,
    requests: Mapping[str, CachedRequestState],
    encoder_outputs: Mapping[str, torch.Tensor],
    block_size: int,
    decode_positions: DecodePositions,
    prunes_output_rows: bool,
) -> StepBatch:
    """The batch of `step` (num_scheduled_tokens > 0) over the runner's requests, whose states the
    step's changes are already applied to, and the encoder outputs by content hash."""
    token_ids: list[int] = []
    positions: list[torch.Tensor] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    block_tables: list[list[int]] = []
    mm_spans: list[tuple[int, torch.Tensor]] = []
    scheduled: list[CachedRequestState] = []
    sampled: list[CachedRequestState] = []
    sample_rows: list[int] = []
    drafts: list[list[int]] = []
    prompt_rows = PromptLogprobsRows()
    for request_id, n in step.num_scheduled_tokens.items():
        state = requests[request_id]
        start, end = state.num_computed_tokens, state.num_computed_tokens + n
        spec = step.scheduled_spec_tokens.get(request_id, [])
        known = len(state.token_ids) + len(spec)
        assert end <= known, f"{request_id}: tokens up to {end} scheduled, {known} known"
        assert not spec or end == known, f"{request_id}: drafts scheduled but not every known token"
        base = len(token_ids)
        token_ids.extend(state.token_ids[start:end])
        token_ids.extend(spec)
        positions.append(state.positions(start, end, decode_positions))
        blocks = state.block_ids
        slots.extend(blocks[t // block_size] * block_size + t % block_size for t in range(start, end))
        for item in state.mm_items:
            lo, hi = max(start, item.offset), min(end, item.end)
            if lo < hi:
                embeds = encoder_outputs[item.content_hash]
                mm_spans.append((base + lo - start, item_rows(embeds, lo - item.offset, hi - item.offset)))
        query_start_loc.append(len(token_ids))
        seq_lens.append(end)
        block_tables.append(blocks)
        scheduled.append(state)
        count = state.params.prompt_logprobs
        if state.samples_prompt_logprobs and count is not None:
            assert state.prompt_logprobs is not None
            prompt_rows.add(state.prompt_logprobs, state.token_ids, start, end, base, count)
        if end == known:  # every known token computed: sample the next one (and check the drafts)
            sample_rows.extend(range(len(token_ids) - 1 - len(spec), len(token_ids)))
            sampled.append(state)
            drafts.append(spec)
    batch = StepBatch(
        token_ids=token_ids,
        positions=torch.cat(positions, dim=1),
        slot_mapping=slots,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        mm_spans=mm_spans,
        scheduled=scheduled,
        sampled=sampled,
        sample_rows=sample_rows,
        drafts=drafts,
        prompt_rows=prompt_rows,
    )
    if prunes_output_rows:
        # A step that uses no row (a prompt's middle chunk) keeps its last: no product on zero rows.
        rows = sorted(set(sample_rows).union(prompt_rows.rows)) or [len(token_ids) - 1]
        batch.output_rows = rows if len(rows) < len(token_ids) else None
    return batch


def attention_metadata(
    slots: list[int],
    query_start_loc: list[int],
    seq_lens: list[int],
    block_rows: list[list[int]],
    block_size: int,
    device: torch.device,
    state_slots: list[int] | None = None,
    has_initial_state: list[bool] | None = None,
) -> AttentionMetadata:
    width = max(len(row) for row in block_rows)
    block_tables = torch.zeros(len(block_rows), width, dtype=torch.long)
    for i, row in enumerate(block_rows):
        block_tables[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
        query_start_loc=query_start_loc,
        seq_lens_host=seq_lens,
        block_size=block_size,
        state_slots=None if state_slots is None else torch.tensor(state_slots, dtype=torch.long, device=device),
        state_slots_host=state_slots,
        has_initial_state=has_initial_state,
    )
