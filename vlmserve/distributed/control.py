"""Control messages between the tensor-parallel ranks, on the group's gloo `cpu_group` (so they
travel between hosts whatever the device): rank 0 broadcasts the bytes it received from the
engine core, and the tokens it sampled, so every rank runs the same step and keeps the same
request state (random sampling included).

Each broadcast is tagged with what it carries. Ranks that run the same code on the same inputs
always meet in the same broadcast; one that was left behind (it failed where rank 0 did not)
meets a broadcast of another kind or for other requests, and raises GroupFailed instead of
going on with state that is no longer rank 0's."""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from vlmserve.distributed.parallel_state import tp_group

# What a broadcast carries (its header's first word).
MESSAGE = 1
SAMPLED = 2

_sampled_encoder = msgspec.msgpack.Encoder()
_sampled_decoder = msgspec.msgpack.Decoder(tuple[list[str], list[int]])


class GroupFailed(BaseException):
    """The group cannot go on: a control broadcast failed (a rank died, its host is gone) or a
    rank's state is no longer rank 0's.

    A BaseException, like SystemExit: it must not be taken for one request's error by the
    runner's retry-them-one-at-a-time path (which catches Exception)."""


def _broadcast(tensor: torch.Tensor) -> None:
    group = tp_group()
    try:
        dist.broadcast(tensor, src=0, group=group.cpu_group)
    except RuntimeError as e:  # gloo: a peer's connection closed or timed out
        raise GroupFailed(f"rank {group.rank}: a control broadcast failed: {e}") from e


def broadcast_bytes(payload: bytes | None, kind: int) -> bytes:
    """Rank 0's `payload` on every rank (the others pass None). Blocks until rank 0 sends."""
    group = tp_group()
    if group.size == 1:
        assert payload is not None
        return payload
    header = torch.zeros(2, dtype=torch.int64)  # [kind, length]
    if group.rank == 0:
        assert payload is not None, "rank 0 sends"
        header[0], header[1] = kind, len(payload)
    _broadcast(header)
    if int(header[0]) != kind:
        raise GroupFailed(f"rank {group.rank} expected a broadcast of kind {kind}, rank 0 sent kind {int(header[0])}")
    length = int(header[1])
    if group.rank == 0:
        assert payload is not None
        if length:
            _broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return payload
    body = torch.empty(length, dtype=torch.uint8)
    if length:
        _broadcast(body)
    return body.numpy().tobytes()


def share_sampled(request_ids: list[str], token_ids: list[int]) -> list[int]:
    """The tokens rank 0 sampled for `request_ids`, on every rank (identity without a group).

    Every rank samples from the same logits, but a random draw without a seed comes from each
    process's own generator: rank 0's tokens are the ones the engine core sees, so they are the
    ones every rank appends to its copy of the requests."""
    group = tp_group()
    if group.size == 1:
        return token_ids
    raw = broadcast_bytes(_sampled_encoder.encode((request_ids, token_ids)) if group.rank == 0 else None, SAMPLED)
    ids, tokens = _sampled_decoder.decode(raw)
    if ids != request_ids:
        raise GroupFailed(f"rank {group.rank} sampled for {request_ids}, rank 0 for {ids}")
    return tokens
