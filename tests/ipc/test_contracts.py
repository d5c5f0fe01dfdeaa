"""The scheduler's and the runner's outputs are plain data: msgspec round trips keep every field
(what a tensor-parallel worker will receive), and a real schedule() produces only such data."""

from __future__ import annotations

import msgspec
import torch

from tests.engine.helpers import make_request
from vlmserve.engine.cache_coordinator import CacheCoordinator
from vlmserve.engine.kv_cache import KVCacheManager
from vlmserve.engine.scheduler import Scheduler, SchedulerConfig
from vlmserve.ipc import serial
from vlmserve.ipc.contracts import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from vlmserve.multimodal.inputs import MultiModalItem
from vlmserve.sampling_params import SamplingParams


class _Holder(msgspec.Struct):
    x: torch.Tensor


def _item(offset: int) -> MultiModalItem:
    return MultiModalItem(
        modality="video",
        offset=offset,
        length=6,
        grid_thw=(2, 2, 6),
        content_hash="abc",
        pixel_values=torch.randn(24, 1176),
        original_size=(640, 480),
        resized_size=(84, 28),
        second_per_grid_t=0.5,
    )


def _assert_same_new(a: NewRequestData, b: NewRequestData) -> None:
    assert (a.request_id, a.prompt_token_ids, a.mrope_delta, a.block_ids, a.num_computed_tokens) == (
        b.request_id,
        b.prompt_token_ids,
        b.mrope_delta,
        b.block_ids,
        b.num_computed_tokens,
    )
    assert a.sampling_params == b.sampling_params and b.sampling_params.stop_strings == ("END",)
    assert (a.mrope_positions is None) == (b.mrope_positions is None)
    if a.mrope_positions is not None:
        assert b.mrope_positions is not None and b.mrope_positions.dtype == torch.int64
        assert torch.equal(a.mrope_positions, b.mrope_positions)
    assert len(a.mm_items) == len(b.mm_items)
    for x, y in zip(a.mm_items, b.mm_items, strict=True):
        assert torch.equal(x.pixel_values, y.pixel_values) and y.pixel_values.dtype == x.pixel_values.dtype
        assert (x.modality, x.offset, x.length, x.grid_thw, x.content_hash, x.second_per_grid_t) == (
            y.modality,
            y.offset,
            y.length,
            y.grid_thw,
            y.content_hash,
            y.second_per_grid_t,
        )
        assert (x.original_size, x.resized_size) == (y.original_size, y.resized_size)


def test_scheduler_output_round_trips_through_msgspec() -> None:
    positions = torch.arange(30).expand(3, -1).clone()
    positions[1, 4:10] = 7
    out = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                request_id="a-0",
                prompt_token_ids=list(range(30)),
                mm_items=[_item(4)],
                mrope_positions=positions,
                mrope_delta=-3,
                sampling_params=SamplingParams(temperature=0.7, top_k=5, seed=11, stop=["END"], logprobs=3),
                block_ids=[3, 9],
                num_computed_tokens=16,
            )
        ],
        scheduled_cached_reqs=[
            CachedRequestData(request_id="b", resumed_from_preemption=True, new_block_ids=[1, 2], num_computed_tokens=0)
        ],
        num_scheduled_tokens={"a-0": 14, "b": 1},
        scheduled_encoder_inputs={"a-0": [0]},
        free_encoder_hashes=["old"],
        finished_req_ids=["c"],
    )
    back = serial.decoder(SchedulerOutput).decode(serial.encode(out))
    _assert_same_new(out.scheduled_new_reqs[0], back.scheduled_new_reqs[0])
    assert back.scheduled_cached_reqs == out.scheduled_cached_reqs
    assert list(back.num_scheduled_tokens.items()) == [("a-0", 14), ("b", 1)]  # batch order kept
    assert back.scheduled_encoder_inputs == {"a-0": [0]}
    assert (back.free_encoder_hashes, back.finished_req_ids) == (["old"], ["c"])
    assert back.total_num_scheduled_tokens == 15
    # bfloat16 pixels keep their bits.
    bf16 = _item(0)
    bf16.pixel_values = bf16.pixel_values.to(torch.bfloat16)
    out.scheduled_new_reqs[0].mm_items = [bf16]
    back = serial.decoder(SchedulerOutput).decode(serial.encode(out))
    assert back.scheduled_new_reqs[0].mm_items[0].pixel_values.dtype == torch.bfloat16
    assert torch.equal(
        back.scheduled_new_reqs[0].mm_items[0].pixel_values.view(torch.int16), bf16.pixel_values.view(torch.int16)
    )


def test_model_runner_and_core_outputs_round_trip_through_msgspec() -> None:
    out = ModelRunnerOutput(
        sampled_token_ids={"a": [151645], "b": [0, 5]},
        logprobs={"a": [TokenLogprobs(-0.25, 2, [(17, -0.1), (151645, -0.25)])]},
        num_kept_tokens={"b": 0},
        draft_token_ids={"a": [3, 4]},
        prompt_logprobs={"a": [TokenLogprobs(-3.5, 40, [(9, -0.5)]), TokenLogprobs(-0.5, 1, [(3, -0.5)])]},
    )
    back = serial.decoder(ModelRunnerOutput).decode(serial.encode(out))
    assert back == out
    core = EngineCoreOutput(
        request_id="a",
        new_token_ids=[151645],
        finish_reason="stop",
        stop_reason=151645,
        num_cached_tokens=16,
        logprobs=out.logprobs["a"],
        num_draft_tokens=3,
        num_accepted_tokens=2,
        prompt_logprobs=out.prompt_logprobs["a"],
    )
    assert serial.decoder(EngineCoreOutput).decode(serial.encode(core)) == core


def test_a_malformed_tensor_is_refused_not_misread() -> None:
    raw = serial.encode(ModelRunnerOutput())
    assert serial.decoder(ModelRunnerOutput).decode(raw) == ModelRunnerOutput()
    bad = msgspec.msgpack.encode({"scheduled_new_reqs": [], "num_scheduled_tokens": {"a": "x"}})
    try:
        serial.decoder(SchedulerOutput).decode(bad)
    except msgspec.ValidationError as e:
        assert "num_scheduled_tokens" in str(e)
    else:
        raise AssertionError("a string token count was accepted")
    short = msgspec.msgpack.Ext(1, b"\x00\x01" + (4).to_bytes(8, "little") + b"\x00" * 3)  # 4 floats, 3 bytes
    payload = msgspec.msgpack.encode({"x": short})
    try:
        serial.decoder(_Holder).decode(payload)
    except msgspec.ValidationError as e:
        assert "does not match" in str(e)
    else:
        raise AssertionError("a truncated tensor was accepted")


def test_a_real_schedule_is_plain_data_and_says_only_what_changed() -> None:
    """New requests come whole once; later steps carry only new block ids; a preempted request
    comes back with its whole new block list; finished ones are named for the runner to drop."""
    kv = CacheCoordinator(KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=False))
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), kv)
    s.add_request(make_request("a", 6, max_tokens=20))
    s.add_request(make_request("b", 6, max_tokens=20, first_token=100))
    first = s.schedule()
    assert [n.request_id for n in first.scheduled_new_reqs] == ["a", "b"] and first.scheduled_cached_reqs == []
    assert [n.block_ids for n in first.scheduled_new_reqs] == [[0, 1], [2, 3]]
    decoded = serial.decoder(SchedulerOutput).decode(serial.encode(first))
    assert [n.prompt_token_ids for n in decoded.scheduled_new_reqs] == [list(range(6)), list(range(100, 106))]
    s.update_from_output(first, ModelRunnerOutput(sampled_token_ids={"a": [1], "b": [2]}))
    # Tokens 6 and 7: block 1 has room; nobody needs a new block.
    for _ in range(2):
        second = s.schedule()
        assert second.scheduled_new_reqs == []
        assert [(c.request_id, c.new_block_ids, c.resumed_from_preemption) for c in second.scheduled_cached_reqs] == [
            ("a", [], False),
            ("b", [], False),
        ]
        s.update_from_output(second, ModelRunnerOutput(sampled_token_ids={"a": [1], "b": [2]}))
    # Token 8 needs a third block each: a takes the last free one, b (the newest) is preempted.
    third = s.schedule()
    assert [(c.request_id, c.new_block_ids) for c in third.scheduled_cached_reqs] == [("a", [4])]
    assert list(third.num_scheduled_tokens) == ["a"] and s.num_preemptions == 1
    s.update_from_output(third, ModelRunnerOutput(sampled_token_ids={"a": [1]}))
    s.finish_request("a", s.requests["a"].status.FINISHED_ABORTED)
    fourth = s.schedule()
    assert fourth.finished_req_ids == ["a"]
    (resumed,) = fourth.scheduled_cached_reqs
    assert resumed.request_id == "b" and resumed.resumed_from_preemption and resumed.num_computed_tokens == 0
    assert resumed.new_block_ids == kv.block_ids["b"] and fourth.num_scheduled_tokens == {"b": 9}
