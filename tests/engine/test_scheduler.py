"""The scheduler driven directly: hand-built requests, sampled tokens supplied by the test."""

from __future__ import annotations

from tests.engine.helpers import encoder_inputs, make_request
from vlmserve.engine.cache_coordinator import CacheCoordinator
from vlmserve.engine.kv_cache import KVCacheManager
from vlmserve.engine.request import RequestStatus
from vlmserve.engine.scheduler import Scheduler, SchedulerConfig
from vlmserve.ipc.contracts import EngineCoreEventType, ModelRunnerOutput, SchedulerOutput


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 32,
    max_seqs: int = 8,
    prefix_caching: bool = True,
    encoder_budget: int = 64,
    encoder_cache: int = 64,
) -> Scheduler:
    config = SchedulerConfig(max_seqs, budget, encoder_budget, encoder_cache)
    return Scheduler(config, CacheCoordinator(KVCacheManager(num_blocks, block_size, prefix_caching)))


def run_step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    sampled = {
        request_id: [token]
        for request_id, n in out.num_scheduled_tokens.items()
        if s.requests[request_id].num_computed_tokens + n == s.requests[request_id].num_tokens
    }
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return out


def test_budget_chunks_long_prompts_and_running_requests_go_first() -> None:
    s = make_scheduler(budget=10)
    a, b = make_request("a", 25), make_request("b", 4)
    s.add_request(a)
    s.add_request(b)
    assert list(run_step(s).num_scheduled_tokens.items()) == [("a", 10)]
    assert list(run_step(s).num_scheduled_tokens.items()) == [("a", 10)]
    # a needs 5 more, b its 4 prompt tokens: both fit in one step, a (running) first.
    assert list(run_step(s).num_scheduled_tokens.items()) == [("a", 5), ("b", 4)]
    assert a.output_token_ids == [7] and b.output_token_ids == [7]
    assert list(run_step(s).num_scheduled_tokens.items()) == [("a", 1), ("b", 1)]  # decoding


def test_new_requests_join_between_steps_and_finished_ones_free_at_once() -> None:
    s = make_scheduler()
    a = make_request("a", 4, max_tokens=2)
    s.add_request(a)
    run_step(s)
    b = make_request("b", 4, max_tokens=5)
    s.add_request(b)
    out = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 4)]
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [7, 7]
    assert "a" not in s.kv.block_ids and "a" not in s.requests
    assert [r.request_id for r in s.running] == ["b"]


def test_eos_and_stop_token_finish_requests() -> None:
    s = make_scheduler()
    a = make_request("a", 3, max_tokens=10)
    s.add_request(a)
    run_step(s, token=99999)  # the request's eos id
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason is None
    assert not s.has_unfinished() and s.kv.pool.num_free == s.kv.pool.num_blocks


def test_max_num_seqs_and_fcfs() -> None:
    s = make_scheduler(max_seqs=2, budget=100)
    for name in "abcd":
        s.add_request(make_request(name, 3))
    out = run_step(s)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c", "d"]


def test_preemption_frees_the_newest_and_recomputes_it() -> None:
    # 6 blocks of 4 tokens. a and b each hold 3 blocks after their 12-token prompts (and their
    # first sampled token); a's next token needs a fourth block: b, the newest, is preempted.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, prefix_caching=False)
    a, b = make_request("a", 11, max_tokens=20), make_request("b", 11, max_tokens=20, first_token=100)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # both prefilled: 11 + 1 sampled token each
    run_step(s)  # token 12 of each: fits in block 3
    assert s.kv.pool.num_free == 0
    out = run_step(s)  # a's 14th token needs a new block -> b preempted
    assert list(out.num_scheduled_tokens) == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert "b" not in s.kv.block_ids and s.waiting[0] is b
    assert b.output_token_ids == [7, 7]  # kept, recomputed on resume
    # Finish a; b comes back and recomputes prompt + its outputs in one chunk.
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    out = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("b", 13)]
    assert b.output_token_ids == [7, 7, 7]


def test_abort_frees_everything_at_once() -> None:
    s = make_scheduler(encoder_cache=10)
    a = make_request("a", 20, images=[(2, 8, "img-a")])
    s.add_request(a)
    s.add_request(make_request("w", 3))
    run_step(s)
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    s.finish_request("w", RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks
    assert not s.running and not s.waiting and not s.requests
    assert s.encoder_cache.users == {"img-a": set()}  # kept for reuse, but nobody holds it
    s.add_request(make_request("b", 20, images=[(2, 9, "img-b")], first_token=500))
    assert s.schedule().free_encoder_hashes == ["img-a"]  # evicted to make room


def test_an_image_split_across_chunks_is_encoded_once_and_kept_until_its_last_token() -> None:
    s = make_scheduler(budget=6)
    a = make_request("a", 20, images=[(2, 10, "img")])  # placeholders 2..11
    s.add_request(a)
    out = run_step(s)  # tokens 0..5: image starts
    assert encoder_inputs(out) == [("a", 0)]
    assert s.encoder_cache.users == {"img": {"a"}}
    out = run_step(s)  # 6..11: image ends exactly here
    assert out.scheduled_encoder_inputs == {}
    assert s.encoder_cache.users == {"img": set()} and "img" in s.encoder_cache.unused


def test_identical_images_in_two_requests_are_encoded_once() -> None:
    s = make_scheduler(budget=100, prefix_caching=False)
    s.add_request(make_request("a", 10, images=[(1, 4, "same")]))
    s.add_request(make_request("b", 10, images=[(1, 4, "same"), (6, 2, "other")], first_token=50))
    out = s.schedule()
    assert encoder_inputs(out) == [("a", 0), ("b", 1)]
    assert (s.encoder_cache.hits, s.encoder_cache.misses) == (1, 2)


def test_encoder_cache_keeps_finished_images_and_evicts_least_recent() -> None:
    s = make_scheduler(budget=100, prefix_caching=False, encoder_cache=10)
    s.add_request(make_request("a", 8, images=[(1, 4, "x")], max_tokens=1))
    s.add_request(make_request("b", 8, images=[(1, 4, "y")], max_tokens=1, first_token=50))
    run_step(s)  # both done; x and y stay cached (8 of 10 tokens)
    s.add_request(make_request("c", 8, images=[(1, 4, "x")], max_tokens=1, first_token=90))
    out = run_step(s)
    assert out.scheduled_encoder_inputs == {}  # x is still there: no encode
    s.add_request(make_request("d", 8, images=[(1, 4, "z")], max_tokens=1, first_token=130))
    out = s.schedule()
    assert encoder_inputs(out) == [("d", 0)]
    assert out.free_encoder_hashes == ["y"]  # x was used more recently than y


def test_chunks_stop_before_an_image_the_encoder_cannot_take() -> None:
    # Encoder cache of 10 tokens. a's 5-token image is in use while a's prompt is computed in
    # chunks of 6; b's 6-token image does not fit beside it, so b's chunk stops before it.
    s = make_scheduler(budget=6, prefix_caching=False, encoder_cache=10)
    s.add_request(make_request("a", 8, images=[(2, 5, "a-img")]))
    s.add_request(make_request("b", 12, images=[(1, 6, "b-img")], first_token=100))
    out = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 6)]  # a-img (2..6) still in use
    out = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 2), ("b", 1)]  # b: token 0 only
    assert out.scheduled_encoder_inputs == {}
    out = run_step(s)  # a-img is released now: b's image fits
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 5)]
    assert encoder_inputs(out) == [("b", 0)]


def test_requests_that_can_never_fit_are_refused() -> None:
    import pytest

    s = make_scheduler(num_blocks=4, block_size=4, encoder_cache=10)
    with pytest.raises(ValueError, match=r"needs 5 KV blocks \(17 prompt tokens \+ 1, 4 per block\).*4 in all"):
        s.add_request(make_request("big", 17))
    with pytest.raises(ValueError, match="an image or video of 12 tokens exceeds the encoder cache \\(10 tokens\\)"):
        s.add_request(make_request("img", 14, images=[(1, 12, "h")]))
    assert not s.requests


def test_prefix_hit_skips_cached_tokens_and_their_images() -> None:
    s = make_scheduler(budget=100)
    s.add_request(make_request("a", 20, images=[(2, 8, "img")], max_tokens=1))
    out = run_step(s)
    assert encoder_inputs(out) == [("a", 0)]
    # Same prompt and picture: 4 full blocks (16 tokens) cached; the image (2..9) lies inside.
    b = make_request("b", 20, images=[(2, 8, "img")], max_tokens=1)
    s.add_request(b)
    out = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("b", 4)]
    assert b.num_cached_tokens == 16
    assert out.scheduled_encoder_inputs == {}
    # Same text, another picture: only the first block (before the image) is reused.
    c = make_request("c", 20, images=[(2, 8, "other")], max_tokens=1)
    s.add_request(c)
    out = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("c", 20)]  # block 0 holds tokens 2, 3 of the image
    assert encoder_inputs(out) == [("c", 0)]


def test_preempted_request_resumes_from_its_cached_blocks() -> None:
    s = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a, b = make_request("a", 11, max_tokens=20), make_request("b", 11, max_tokens=20, first_token=100)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    run_step(s)
    run_step(s)  # b preempted; its 3 full blocks stay cached
    assert b.status == RequestStatus.PREEMPTED
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    out = run_step(s)
    # Only the block a took from b was evicted: b finds 2 of its blocks and recomputes 5 tokens.
    assert list(out.num_scheduled_tokens.items()) == [("b", 5)]
    assert b.num_cached_tokens == 8


def test_an_empty_request_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="the prompt is empty"):
        make_scheduler().add_request(make_request("empty", 0))


def test_the_newest_request_is_preempted_mid_image_and_its_encoder_output_stays_cached() -> None:
    # 6 blocks of 4 tokens, 19 tokens a step. Step 1 admits a (6 text tokens), m (8 tokens, an
    # image at 1..4) and b, the newest (14 tokens, a video at 2..9), whose first chunk (5 tokens)
    # ends inside its video: every block is taken. In step 2, m's 9th token needs a block: b is
    # preempted, not a (the oldest) nor m (the request asking).
    s = make_scheduler(num_blocks=6, block_size=4, budget=19, prefix_caching=False)
    a = make_request("a", 6, max_tokens=3)
    m = make_request("m", 8, images=[(1, 4, "m-img")], max_tokens=6, first_token=100)
    b = make_request("b", 14, images=[(2, 8, "b-vid")], max_tokens=3, first_token=200)
    b.mm_items[0].modality = "video"  # the scheduler handles both alike
    for r in (a, m, b):
        s.add_request(r)
    out = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 6), ("m", 8), ("b", 5)]
    assert encoder_inputs(out) == [("m", 0), ("b", 0)]
    assert s.kv.pool.num_free == 0 and s.encoder_cache.users["b-vid"] == {"b"}  # b is inside its video

    out = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("m", 1)]
    assert (b.status, b.num_preemptions, b.num_computed_tokens) == (RequestStatus.PREEMPTED, 1, 0)
    assert (a.num_preemptions, m.num_preemptions, s.num_preemptions) == (0, 0, 1)
    assert [r.request_id for r in s.running] == ["a", "m"] and list(s.waiting) == [b]
    assert "b" not in s.kv.block_ids
    # b no longer holds its video's encoder output, but the output stays cached for its return.
    assert s.encoder_cache.users["b-vid"] == set() and "b-vid" in s.encoder_cache.unused
    assert out.free_encoder_hashes == []

    # a finishes at step 3 and m at step 6; b then comes back, computes its whole prompt in one
    # chunk and finds its video in the encoder cache: no second encode.
    hits = s.encoder_cache.hits
    resumed = []
    for _ in range(10):
        out = run_step(s)
        resumed += [(n, encoder_inputs(out)) for rid, n in out.num_scheduled_tokens.items() if rid == "b"]
        if not s.has_unfinished():
            break
    assert resumed[0] == (14, [])
    assert s.encoder_cache.hits == hits + 1 and s.encoder_cache.misses == 2
    assert b.output_token_ids == [7, 7, 7] and s.num_preemptions == 1


def test_a_request_preempted_mid_image_re_encodes_it_on_resume_after_eviction() -> None:
    # Encoder cache of 10 tokens, at most 8 encoded per step (one image past the first), 12
    # tokens a step, 8 blocks of 4. a (7 text tokens) runs first; then r, older than b, holds a
    # 2-token image Z at 2..3 and an 8-token image Y at 6..13; b holds a 6-token image X at 3..8.
    s = make_scheduler(num_blocks=8, block_size=4, budget=12, encoder_budget=8, encoder_cache=10)
    a = make_request("a", 7, max_tokens=6)
    s.add_request(a)
    run_step(s)
    r = make_request("r", 15, images=[(2, 2, "Z"), (6, 8, "Y")], max_tokens=2, first_token=100)
    b = make_request("b", 14, images=[(3, 6, "X")], max_tokens=3, first_token=200)
    s.add_request(r)
    s.add_request(b)

    # Step 2: Z + Y exceed the step's encoder budget, so r's chunk stops before Y; b's first
    # chunk (tokens 0..4) ends inside X.
    out = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("r", 6), ("b", 5)]
    assert [(rid, s.requests[rid].mm_items[i].content_hash) for rid, i in encoder_inputs(out)] == [
        ("r", "Z"),
        ("b", "X"),
    ]
    assert s.kv.pool.num_free == 2

    # Step 3: r cannot take Y while b holds X (6 + 8 > 10); a takes a third block, and b's next
    # chunk (tokens 5..13) needs two more with one left: b, the newest, is preempted and lets go
    # of X.
    out = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1)]
    assert b.status == RequestStatus.PREEMPTED and (a.num_preemptions, r.num_preemptions) == (0, 0)
    assert s.encoder_cache.users["X"] == set()

    # Step 4: r encodes Y, which evicts Z and X.
    out = run_step(s)
    assert [(rid, s.requests[rid].mm_items[i].content_hash) for rid, i in encoder_inputs(out)] == [("r", "Y")]
    assert out.free_encoder_hashes == ["Z", "X"] and not s.encoder_cache.has("X")

    # b comes back once r is done (a still decoding). Its first block (tokens 0..3, X's first placeholder
    # included) is still in the prefix cache, so it resumes at token 4, inside X: X must be
    # encoded again although the chunk does not hold X's first placeholder.
    for _ in range(10):
        out = run_step(s)
        if "b" in out.num_scheduled_tokens:
            break
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 10)]
    assert b.num_cached_tokens == 4 and b.mm_items[0].offset < 4 < b.mm_items[0].end
    assert encoder_inputs(out) == [("b", 0)]
    while s.has_unfinished():
        run_step(s)
    assert b.output_token_ids == [7, 7, 7] and s.num_preemptions == 1


def test_a_request_longer_than_the_whole_kv_pool_ends_at_its_capacity_instead_of_waiting_forever() -> None:
    # 4 blocks of 4: 16 tokens of KV in all. A 10-token prompt asking for 20 tokens would outgrow
    # the pool, preempt itself and never be admitted again; it stops with "length" at 10 + 7 tokens
    # (the 7th sampled token needs no KV), and the queue behind it moves on.
    s = make_scheduler(num_blocks=4, block_size=4, budget=32)
    long = make_request("long", 10, max_tokens=20)
    s.add_request(long)
    s.add_request(make_request("next", 3, max_tokens=2, first_token=50))
    for _ in range(40):
        if not s.has_unfinished():
            break
        run_step(s)
    assert not s.has_unfinished()
    assert long.status == RequestStatus.FINISHED_LENGTH and len(long.output_token_ids) == 7
    assert s.num_preemptions == 0 and s.kv.pool.num_free == 4


def test_with_log_stats_outputs_carry_each_request_s_events_once_in_order() -> None:
    # As the preemption test above: b is preempted at the third step and resumes when a is gone.
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, prefix_caching=False)
    s.log_stats = True
    a, b = make_request("a", 11, max_tokens=20), make_request("b", 11, max_tokens=20, first_token=100)
    s.add_request(a)
    s.add_request(b)

    def step() -> dict[str, list[tuple[EngineCoreEventType, float]] | None]:
        out = s.schedule()
        sampled = {
            rid: [7]
            for rid, n in out.num_scheduled_tokens.items()
            if s.requests[rid].num_tokens == n + s.requests[rid].num_computed_tokens
        }
        outputs = s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        return {o.request_id: None if o.events is None else [(e.type, e.timestamp) for e in o.events] for o in outputs}

    first = step()
    Q, S, P = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED, EngineCoreEventType.PREEMPTED
    for rid in "ab":
        events = first[rid]
        assert events is not None and [t for t, _ in events] == [Q, S]
        assert events[0][1] <= events[1][1]  # the engine's clock: queued, then scheduled
    assert step() == {"a": None, "b": None}  # nothing new: no events
    assert step() == {"a": None}  # b preempted: its event waits for its next output
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    resumed = step()["b"]
    assert resumed is not None and [t for t, _ in resumed] == [P, S]
    assert first["b"] is not None and first["b"][1][1] <= resumed[0][1] <= resumed[1][1]


def test_without_log_stats_no_events_are_recorded() -> None:
    s = make_scheduler()
    a = make_request("a", 4, max_tokens=2)
    s.add_request(a)
    out = s.schedule()
    (output,) = s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": [7]}))
    assert output.events is None and a.events == []


# -- the fair share among owners (the server's HTTP requests) -----------------------------------


def test_waiting_requests_are_admitted_from_the_owner_with_the_fewest_running() -> None:
    s = make_scheduler(max_seqs=4, budget=100)
    for i in range(4):
        s.add_request(make_request(f"a{i}", 3, owner="A", first_token=10 * i))
    s.add_request(make_request("b0", 3, owner="B", first_token=100))
    s.add_request(make_request("b1", 3, owner="B", first_token=110))
    # Turn about: A (first to come), B, A, B; first come first served would run a0..a3.
    assert list(run_step(s).num_scheduled_tokens) == ["a0", "b0", "a1", "b1"]
    assert [r.request_id for r in s.waiting] == ["a2", "a3"]
    # A plain request arriving behind a long queue is admitted at the first free sequence.
    s.add_request(make_request("c", 3, owner="C", first_token=200))
    s.finish_request("a0", RequestStatus.FINISHED_ABORTED)
    assert "c" in run_step(s).num_scheduled_tokens and [r.request_id for r in s.waiting] == ["a2", "a3"]


def test_a_short_prompt_gets_its_share_of_the_budget_beside_another_owners_long_prefill() -> None:
    s = make_scheduler(budget=16)
    s.add_request(make_request("a0", 40, owner="A"))
    s.add_request(make_request("a1", 40, owner="A", first_token=100))
    assert list(run_step(s).num_scheduled_tokens.items()) == [("a0", 16)]  # one owner: first come first
    s.add_request(make_request("b", 6, owner="B", first_token=200))
    # B asks for less than half the budget: it gets all of it, A the rest.
    assert dict(run_step(s).num_scheduled_tokens) == {"a0": 10, "b": 6}
    s.add_request(make_request("c", 30, owner="C", first_token=300))
    # b decodes (1 token); A and C, both wanting more, split the other 15: C, wanting less (30
    # against 54), gets the half rounded up.
    assert dict(run_step(s).num_scheduled_tokens) == {"b": 1, "a0": 7, "c": 8}


def test_preemption_takes_the_newest_sequence_of_the_owner_with_the_most_running() -> None:
    # 8 blocks of 4 tokens; A's three requests and B's one hold 2 blocks each after their 7-token
    # prompts. When each needs a third block, B (the newest, but holding least) keeps running:
    # A's newest are preempted, not B.
    s = make_scheduler(num_blocks=8, block_size=4, budget=64, prefix_caching=False)
    a = [make_request(f"a{i}", 7, max_tokens=20, owner="A", first_token=10 * i) for i in range(3)]
    b = make_request("b", 7, max_tokens=20, owner="B", first_token=100)
    for r in [*a, b]:
        s.add_request(r)
    run_step(s)
    run_step(s)  # token 8 of each: the last slot of block 2
    assert s.kv.pool.num_free == 0
    out = run_step(s)
    assert set(out.num_scheduled_tokens) == {"b", "a0"}
    assert b.status == RequestStatus.RUNNING and b.num_preemptions == 0
    assert [r.status for r in a] == [RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.PREEMPTED]


def test_a_newcomer_finding_every_place_taken_gets_one_from_the_largest_holder() -> None:
    s = make_scheduler(max_seqs=3, budget=100)
    for i in range(3):
        s.add_request(make_request(f"a{i}", 3, max_tokens=50, owner="A", first_token=10 * i))
    s.add_request(make_request("a3", 3, max_tokens=50, owner="A", first_token=40))  # A's own: it waits
    run_step(s)
    assert len(s.running) == 3 and [r.request_id for r in s.waiting] == ["a3"]
    run_step(s)
    assert s.num_preemptions == 0  # an owner's own queue never preempts it
    s.add_request(make_request("b", 3, max_tokens=2, owner="B", first_token=100))
    out = run_step(s)
    # A's newest running sequence made room: b runs now, not when A's 50-token sequences end.
    assert "b" in out.num_scheduled_tokens and s.requests["a2"].status == RequestStatus.PREEMPTED
    assert [r.request_id for r in s.waiting] == ["a2", "a3"]
    run_step(s)  # b's second and last token
    assert "b" not in s.requests
    out = run_step(s)
    assert "a2" in out.num_scheduled_tokens  # the preempted one resumes first
