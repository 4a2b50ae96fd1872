"""Scheduler decisions asserted exactly: budgets, chunking, admission, preemption, cancellation."""

from cluster.config import CacheConfig, SchedulerConfig
from cluster.engine.block_pool import BlockPool
from cluster.engine.request import RequestStatus
from cluster.engine.scheduler import Scheduler
from tests.helpers import make_request


def make_scheduler(num_blocks=16, budget=64, max_seqs=8, chunk=None, block_size=4, prefix=True):
    pool = BlockPool(num_blocks, enable_prefix_caching=prefix)
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, long_prefill_token_threshold=chunk),
        CacheConfig(block_size=block_size),
        pool,
    )
    return s, pool


def plan(out):
    return [(s.request.request_id, s.num_tokens) for s in out.scheduled]


def fake_step(s, out, token=1):
    """What the engine does after a step: advance, then append a token where one was sampled."""
    sampling = [x.request for x in out.scheduled if x.samples]
    s.update_after_step(out)
    for r in sampling:
        r.output_token_ids.append(token)


def test_prompts_are_chunked_under_the_token_budget():
    s, pool = make_scheduler(budget=10)
    a, b = make_request("a", 8), make_request("b", prompt=range(50, 58))
    s.add(a), s.add(b)
    out = s.schedule()
    assert plan(out) == [("a", 8), ("b", 2)]
    assert a.block_ids == [0, 1] and b.block_ids == [2]
    fake_step(s, out)
    out = s.schedule()
    # a decodes (1 token, first in batch order), b continues its prompt with what is left
    assert plan(out) == [("a", 1), ("b", 6)]
    assert out.scheduled[1].samples
    pool.check_integrity()


def test_long_prefill_threshold_caps_a_chunk():
    s, _ = make_scheduler(budget=64, chunk=5)
    s.add(make_request("a", 12))
    assert plan(s.schedule()) == [("a", 5)]


def test_max_num_seqs_limits_admission():
    s, _ = make_scheduler(max_seqs=2)
    for i in range(3):
        s.add(make_request(f"r{i}", 2))
    assert plan(s.schedule()) == [("r0", 2), ("r1", 2)]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_admission_waits_for_free_blocks():
    s, pool = make_scheduler(num_blocks=3, budget=64)
    a, b = make_request("a", 8), make_request("b", 8)
    s.add(a), s.add(b)
    out = s.schedule()
    assert plan(out) == [("a", 8)]  # b needs 2 blocks, only 1 is free
    assert b.status == RequestStatus.WAITING and b.block_ids == []
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert plan(s.schedule()) == [("b", 8)]
    pool.check_integrity()


def test_preemption_by_recompute_when_blocks_run_out():
    s, pool = make_scheduler(num_blocks=4, budget=64)
    a, b = make_request("a", 8), make_request("b", prompt=range(50, 57))
    s.add(a), s.add(b)
    fake_step(s, s.schedule())  # a: 8 tokens in blocks 0,1 ; b: 7 tokens in blocks 2,3
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    fake_step(s, s.schedule())  # a decodes token 9 -> needs block 3rd, none free
    # the step above preempted b (newest) to give a its block
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert a.block_ids == [0, 1, 3]
    assert list(s.waiting) == [b]
    pool.check_integrity()


def test_preempted_request_recomputes_prompt_and_outputs():
    s, pool = make_scheduler(num_blocks=4, budget=64, prefix=False)
    a, b = make_request("a", 8), make_request("b", 7)
    s.add(a), s.add(b)
    fake_step(s, s.schedule())
    fake_step(s, s.schedule())  # b preempted, it had sampled one token: 8 tokens to recompute
    assert b.num_tokens == 8
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert plan(out) == [("b", 8)] and out.scheduled[0].samples


def test_prefix_cache_hit_skips_computed_blocks():
    s, pool = make_scheduler(num_blocks=8, budget=64)
    prompt = list(range(100, 110))  # 2 full blocks of 4 + 2 tokens
    a = make_request("a", prompt=prompt)
    s.add(a)
    fake_step(s, s.schedule())
    assert pool.num_cached_blocks == 2
    b = make_request("b", prompt=prompt)
    s.add(b)
    out = s.schedule()
    assert ("b", 2) in plan(out)  # only the last partial block is computed
    assert b.block_ids[:2] == a.block_ids[:2] and b.num_cached_tokens == 8
    assert pool.ref_count(a.block_ids[0]) == 2


def test_fully_cached_prompt_still_computes_its_last_token():
    s, pool = make_scheduler(num_blocks=8, budget=64)
    prompt = list(range(100, 108))  # exactly 2 blocks
    a = make_request("a", prompt=prompt)
    s.add(a)
    fake_step(s, s.schedule())
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    b = make_request("b", prompt=prompt)
    s.add(b)
    out = s.schedule()
    assert plan(out) == [("b", 4)]  # block 0 hit, block 1 recomputed so the last token yields logits
    assert b.num_cached_tokens == 4


def test_cancellation_frees_blocks_at_once_and_is_idempotent():
    s, pool = make_scheduler(num_blocks=8)
    a = make_request("a", 10)
    s.add(a)
    s.schedule()
    assert pool.num_free_blocks == 5
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert pool.num_free_blocks == 8 and not s.running
    pool.check_integrity()


def test_remote_reservation_complete_and_fallback():
    s, pool = make_scheduler(num_blocks=8)
    a = make_request("a", 10)
    assert s.reserve_remote(a)
    assert a.status == RequestStatus.WAITING_FOR_REMOTE_KV and a.block_ids == [0, 1, 2]
    assert s.schedule().is_empty  # waiting for KV: never scheduled
    s.complete_remote(a, first_token_id=42)
    assert a.num_computed_tokens == 10 and a.output_token_ids == [42]
    assert plan(s.schedule()) == [("a", 1)]

    b = make_request("b", 6)  # shares its first block [10..13] with a
    assert s.reserve_remote(b)
    assert b.block_ids == [0, 3] and b.num_cached_tokens == 4
    s.fallback_to_local(b)
    # the local prefix-cache hit is kept, the block meant for transferred KV is freed
    assert b.status == RequestStatus.WAITING and b.block_ids == [0] and b.num_computed_tokens == 4
    assert ("b", 2) in plan(s.schedule())
    pool.check_integrity()


def test_remote_reservation_refused_when_short_changes_nothing():
    s, pool = make_scheduler(num_blocks=2)
    assert not s.reserve_remote(make_request("a", 12))
    assert pool.num_free_blocks == 2 and not s.remote


def test_admission_never_evicts_its_own_prefix_hits():
    # Regression: allocating before referencing the hits let allocation evict a hit block and
    # hand it out a second time to the same request.
    s, pool = make_scheduler(num_blocks=3, budget=64)
    prompt = list(range(100, 108))
    a = make_request("a", prompt=prompt)
    s.add(a)
    fake_step(s, s.schedule())
    s.finish(a, RequestStatus.FINISHED_STOPPED)  # blocks 0, 1 cached; reusable: 2, 1, 0
    c = make_request("c", prompt=[1, 2, 3])
    s.add(c)
    s.schedule()
    assert c.block_ids == [2]  # reusable now holds only the cached hits: 1, 0
    b = make_request("b", prompt=prompt + [7, 7, 7, 7])
    s.add(b)
    out = s.schedule()
    assert "b" not in dict(plan(out))  # needs one block beyond its hits: none is free, so it waits
    assert pool.lookup_prefix(b.block_hashes[:2]) == [0, 1]  # the hits survived
    pool.check_integrity()
    s.finish(c, RequestStatus.FINISHED_STOPPED)
    assert ("b", 4) in plan(s.schedule())
    assert b.block_ids == [0, 1, 2]
    pool.check_integrity()


def test_a_request_waits_for_a_shared_prefix_being_computed_then_takes_it_from_the_cache():
    """The n choices of one request (same prompt), and requests sharing a system prompt: a follower waits while
    the first computes the shared blocks, then hits the prefix cache; unrelated requests go on meanwhile."""
    s, pool = make_scheduler(num_blocks=32, budget=64, chunk=8)
    first, same = make_request("first", 16), make_request("same", 16)
    other = make_request("other", prompt=range(50, 58))
    for r in (first, same, other):
        s.add(r)
    out = s.schedule()
    assert plan(out) == [("first", 8), ("other", 8)]  # "same" waits: "first" is computing their blocks
    assert [r.request_id for r in s.waiting] == ["same"]
    fake_step(s, out)
    out = s.schedule()
    assert plan(out) == [("other", 1), ("first", 8)]  # still computing the shared blocks: "same" still waits
    fake_step(s, out)
    out = s.schedule()
    assert dict(plan(out))["same"] == 4 and same.num_cached_tokens == 12  # 3 blocks from the cache
    pool.check_integrity()
