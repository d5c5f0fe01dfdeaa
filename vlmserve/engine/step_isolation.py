"""One failed request does not fail its step: a step that raises is undone and its requests run
again one at a time; only those that raise alone fail (the core frees them).

What a step changes of a request the runner holds (its blocks, computed tokens, sampled tokens,
seeded generator) is snapshotted before it runs and restored after it raised. A model with
per-request recurrent state cannot be undone that cheaply (the failed step may have updated
states in place: a copy of every scheduled slot before every step would cost megabytes per
request per layer), so there every request of the failed step fails."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vlmserve.engine.model_runner import ModelRunner
from vlmserve.ipc.contracts import ModelRunnerOutput, SchedulerOutput
from vlmserve.ipc.worker_messages import StepResult

logger = logging.getLogger(__name__)


@dataclass
class _RequestSnapshot:
    """What a step changes of a request the runner already holds."""

    block_ids: list[int]
    num_computed_tokens: int
    num_token_ids: int
    generator_state: torch.Tensor | None


# Per scheduled request, its state before the step; None: the step brings it new.
StepSnapshot = dict[str, _RequestSnapshot | None]


def execute_or_isolate(runner: ModelRunner, step: SchedulerOutput) -> StepResult:
    """Run the step. If it raises, the step is undone and its requests run one at a time: those
    that still raise are named in `failed` (the runner has forgotten them)."""
    saved = snapshot(runner, step)
    try:
        return StepResult(runner.execute(step))
    except Exception:
        logger.exception("a step of %d requests failed; retrying them one at a time", len(saved))
    output, failed = execute_one_at_a_time(runner, step, saved)
    return StepResult(output, failed)


def snapshot(runner: ModelRunner, step: SchedulerOutput) -> StepSnapshot:
    """What `runner.execute(step)` may change of the requests it runs, taken before it runs."""
    saved: StepSnapshot = {}
    for request_id in step.num_scheduled_tokens:
        state = runner.requests.get(request_id)
        if state is None:
            saved[request_id] = None
            continue
        generator = state.generator
        saved[request_id] = _RequestSnapshot(
            list(state.block_ids),
            state.num_computed_tokens,
            len(state.token_ids),
            None if generator is None else generator.get_state(),
        )
    return saved


def _undo(runner: ModelRunner, step: SchedulerOutput, saved: StepSnapshot) -> None:
    """New requests forgotten, the others as before the step; its finished ones and freed encoder
    outputs gone, as the step would have left them."""
    for request_id, before in saved.items():
        if before is None:
            runner.requests.pop(request_id, None)
            continue
        state = runner.requests[request_id]
        state.block_ids = list(before.block_ids)
        state.num_computed_tokens = before.num_computed_tokens
        del state.token_ids[before.num_token_ids :]
        if state.generator is not None and before.generator_state is not None:
            state.generator.set_state(before.generator_state)
    for request_id in step.finished_req_ids:
        runner.requests.pop(request_id, None)
    runner.free_encoder_outputs(step.free_encoder_hashes)


def _alone(runner: ModelRunner, step: SchedulerOutput, request_id: str) -> SchedulerOutput:
    """The step as it would be for this one request: its data, its grammar's row, and every image
    its chunk reads whose encoder output is missing (its encoding may have been another
    request's, or part of the batch that failed)."""
    n = step.num_scheduled_tokens[request_id]
    one = SchedulerOutput(num_scheduled_tokens={request_id: n})
    new = [data for data in step.scheduled_new_reqs if data.request_id == request_id]
    if new:
        one.scheduled_new_reqs = new
        items, start = new[0].mm_items, new[0].num_computed_tokens
    else:
        one.scheduled_cached_reqs = [data for data in step.scheduled_cached_reqs if data.request_id == request_id]
        items, start = runner.requests[request_id].mm_items, one.scheduled_cached_reqs[0].num_computed_tokens
    missing = [
        i
        for i, item in enumerate(items)
        if item.offset < start + n and item.end > start and item.content_hash not in runner.encoder_cache
    ]
    if missing:
        one.scheduled_encoder_inputs = {request_id: missing}
    if request_id in step.scheduled_spec_tokens:
        one.scheduled_spec_tokens = {request_id: step.scheduled_spec_tokens[request_id]}
    if request_id in step.num_drafts_wanted:
        one.num_drafts_wanted = {request_id: step.num_drafts_wanted[request_id]}
    if step.grammar_bitmask is not None and request_id in step.structured_output_request_ids:
        rows = [i for i, r in enumerate(step.structured_output_request_ids) if r == request_id]  # one per sampled row
        one.structured_output_request_ids = [request_id] * len(rows)
        one.grammar_bitmask = step.grammar_bitmask[rows[0] : rows[-1] + 1]
    return one


def execute_one_at_a_time(
    runner: ModelRunner, step: SchedulerOutput, saved: StepSnapshot
) -> tuple[ModelRunnerOutput, dict[str, str]]:
    """After `runner.execute(step)` raised: undo what it did, then run its requests one at a time.
    Returns the output of those that ran, and request id -> why for those that raised again
    (forgotten here; the caller frees them in the scheduler)."""
    _undo(runner, step, saved)
    if runner.state_layers:
        for request_id in step.num_scheduled_tokens:
            runner.requests.pop(request_id, None)
        why = "the engine failed a step holding this request (its per-request state cannot be rolled back)"
        return ModelRunnerOutput(), dict.fromkeys(step.num_scheduled_tokens, why)
    merged = ModelRunnerOutput()
    failed: dict[str, str] = {}
    for request_id in step.num_scheduled_tokens:
        try:
            result = runner.execute(_alone(runner, step, request_id))
        except Exception as e:
            logger.exception("request %s failed", request_id)
            runner.requests.pop(request_id, None)
            failed[request_id] = f"the engine failed computing this request ({type(e).__name__})"
            continue
        merged.sampled_token_ids.update(result.sampled_token_ids)
        merged.logprobs.update(result.logprobs)
        merged.prompt_logprobs.update(result.prompt_logprobs)
        merged.num_kept_tokens.update(result.num_kept_tokens)
        merged.draft_token_ids.update(result.draft_token_ids)
    return merged, failed
