"""Drafts from the model's own draft head (speculative decoding's "mtp": Qwen3.5's multi-token
prediction), proposed after a step's tokens are sampled.

The head runs beside the model: at position p it reads the model's hidden state at p and the
token at p + 1, writes its own KV at p, and predicts the token at p + 2. So after each step:
1. it runs over every row of the step whose token stands (a prompt chunk's rows, a decode's,
   a verification's up to its last accepted draft), paired with the token after each: its KV
   follows the model's, position for position;
2. for each request that drafts, its last row's prediction is the first draft; each further draft
   runs the head one position on, on its own output and the draft before (written at KV slots
   the scheduler holds past the step: SchedulerConfig.draft_lookahead).
Drafts are the head's most likely tokens (as vLLM's proposer takes them); they are checked by
the model in the next step like any other, so they change how much is accepted, never what."""

from __future__ import annotations

import torch

from vlmserve.attention.metadata import AttentionMetadata
from vlmserve.engine.request_state import CachedRequestState
from vlmserve.engine.step_batch import StepBatch, attention_metadata
from vlmserve.ipc.contracts import ModelRunnerOutput, SchedulerOutput
from vlmserve.models.base import VLModel


def propose(
    model: VLModel,
    batch: StepBatch,
    hidden: torch.Tensor,
    step: SchedulerOutput,
    out: ModelRunnerOutput,
    block_size: int,
    device: torch.device,
) -> None:
    """After sampling: the head's KV over the step's standing rows, and into out.draft_token_ids
    the drafts of each request step.num_drafts_wanted names. hidden: every row's [rows, hidden].
    The head's output is needed only at a drafting request's last row: the other rows only write
    its keys and values (draft_fill), a third of its layer's work."""
    fill = _Rows()  # rows whose head output nothing reads
    last = _Rows()  # each drafting request's last standing row
    drafting: list[tuple[CachedRequestState, int, int]] = []  # (request, its next position, drafts wanted)
    loc = batch.query_start_loc
    for i, state in enumerate(batch.scheduled):
        first, count = loc[i], loc[i + 1] - loc[i]
        start = batch.seq_lens[i] - count
        sampled = out.sampled_token_ids.get(state.request_id)
        rejected = 0
        if sampled is not None:
            rejected = len(step.scheduled_spec_tokens.get(state.request_id, ())) - (len(sampled) - 1)
            count -= rejected
        count = min(count, len(state.token_ids) - 1 - start)  # each row needs the token after it
        if count <= 0:
            continue
        wanted = step.num_drafts_wanted.get(state.request_id, 0) if sampled is not None else 0
        if rejected and sampled is not None and len(sampled) == 1:
            # Every draft of this step rejected: none after it either. (The scheduler's backoff,
            # which set `wanted` before this step ran, learns of the rejection only after it.)
            wanted = 0
        kept = count - 1 if wanted > 0 else count
        if kept:
            fill.add(state, first, start, kept, batch)
        if wanted > 0:
            last.add(state, first + kept, start + kept, 1, batch)
            drafting.append((state, start + count, wanted))
    if fill.rows:
        model.draft_fill(*fill.inputs(hidden, batch, block_size, device))
    if not drafting:
        return
    current = model.draft_forward(*last.inputs(hidden, batch, block_size, device))
    drafts: list[list[int]] = [[] for _ in drafting]
    for j in range(max(wanted for _, _, wanted in drafting)):
        predicted = model.compute_logits(current).argmax(dim=-1).tolist()
        live = [k for k, (_, _, wanted) in enumerate(drafting) if len(drafts[k]) < wanted]
        for k in live:
            drafts[k].append(predicted[k])
        more = [k for k in live if len(drafts[k]) < drafting[k][2]]
        if not more:
            break
        # One position on: the head's own output beside the draft it just made.
        step_slots, step_lens, step_blocks, positions = [], [], [], []
        for k in more:
            state, next_position, _ = drafting[k]
            p = next_position + j  # the position after the last standing row's, then on
            step_slots.append(state.block_ids[p // block_size] * block_size + p % block_size)
            step_lens.append(p + 1)
            step_blocks.append(state.block_ids)
            positions.append(state.positions(p, p + 1, model.decode_positions))
        meta = attention_metadata(step_slots, list(range(len(more) + 1)), step_lens, step_blocks, block_size, device)
        ids = torch.tensor([drafts[k][-1] for k in more], dtype=torch.long, device=device)
        pick = torch.tensor(more, device=device)
        current_more = model.draft_forward(ids, current[pick], torch.cat(positions, dim=1).to(device), meta)
        current = current.clone()
        current[pick] = current_more
    for (state, _, _), mine in zip(drafting, drafts, strict=True):
        out.draft_token_ids[state.request_id] = mine


class _Rows:
    """Rows of the step the head runs on, laid out as a step of their own: row r of the batch
    (position p) beside the token at p + 1."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.tokens: list[int] = []
        self.slots: list[int] = []
        self.query_start_loc = [0]
        self.seq_lens: list[int] = []
        self.block_rows: list[list[int]] = []

    def add(self, state: CachedRequestState, first_row: int, position: int, count: int, batch: StepBatch) -> None:
        self.rows += range(first_row, first_row + count)
        self.tokens += state.token_ids[position + 1 : position + 1 + count]
        self.slots += batch.slot_mapping[first_row : first_row + count]
        self.query_start_loc.append(self.query_start_loc[-1] + count)
        self.seq_lens.append(position + count)
        self.block_rows.append(state.block_ids)

    def inputs(
        self, hidden: torch.Tensor, batch: StepBatch, block_size: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(token ids, hidden states, positions, metadata): draft_forward's or draft_fill's."""
        index = torch.tensor(self.rows, dtype=torch.long, device=device)
        meta = attention_metadata(self.slots, self.query_start_loc, self.seq_lens, self.block_rows, block_size, device)
        ids = torch.tensor(self.tokens, dtype=torch.long, device=device)
        return ids, hidden.index_select(0, index), batch.positions[:, self.rows].to(device), meta
