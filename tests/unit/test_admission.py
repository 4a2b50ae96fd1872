"""Admission counts, drain rate, and the prefix estimator (no Ray)."""

import pytest

from cluster.prefix_hash import hash_full_blocks
from cluster.serving.config import AdmissionConfig
from router.admission import AdmissionController, PrefixEstimator
from router.classifier import Route


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_admit_release_counts():
    clock = FakeClock()
    ac = AdmissionController(AdmissionConfig(initial_tokens_per_s=50.0), clock=clock)
    t1 = ac.admit(Route.REMOTE, 120)
    t2 = ac.admit(Route.REMOTE, 30)
    ac.admit(Route.LOCAL, 10)
    snap = ac.snapshot()
    assert (snap.remote.inflight_requests, snap.remote.inflight_tokens) == (2, 150)
    assert (snap.local.inflight_requests, snap.local.inflight_tokens) == (1, 10)
    assert snap.remote.tokens_per_s == 50.0  # nothing finished yet: the configured guess
    ac.release(t1)
    clock.t += 2.0
    ac.release(t2)
    assert ac.inflight(Route.REMOTE) == (0, 0)
    # 150 tokens finished over 2 s
    assert ac.snapshot().remote.tokens_per_s == 75.0


def test_drain_rate_window_forgets_old_requests():
    clock = FakeClock()
    ac = AdmissionController(AdmissionConfig(initial_tokens_per_s=7.0), window_s=10.0, clock=clock)
    for _ in range(2):
        ac.release(ac.admit(Route.LOCAL, 100))
        clock.t += 1
    clock.t += 60
    assert ac.snapshot().local.tokens_per_s == 7.0


def test_prefix_estimator_longest_known_prefix():
    est = PrefixEstimator(capacity_blocks=100)
    a = hash_full_blocks(list(range(64)), 16)
    b = hash_full_blocks(list(range(32)) + [999] * 32, 16)
    assert est.cached_blocks(a) == 0
    est.record(a)
    assert est.cached_blocks(a) == 4
    assert est.cached_blocks(b) == 2  # shares the first two blocks only


def test_prefix_estimator_lru_capacity():
    est = PrefixEstimator(capacity_blocks=3)
    a = hash_full_blocks(list(range(48)), 16)
    est.record(a)
    est.record(hash_full_blocks([7] * 16, 16))
    assert est.cached_blocks(a) == 0  # the oldest (first) block was evicted


def test_prefill_rate_counts_busy_time_only():
    clock = FakeClock()
    ac = AdmissionController(AdmissionConfig(), window_s=30.0, clock=clock, ttft_target_s=2.0)
    # Four requests of 100 uncached prompt tokens, two at a time, each pair prefilled in 1 s; idle 5 s between.
    for _ in range(2):
        tickets = [ac.admit(Route.REMOTE, 200, prefill_tokens=100) for _ in range(2)]
        assert ac.snapshot().remote.waiting_prefill_tokens == 200
        clock.t += 1.0
        for t in tickets:
            ac.first_token(t)
        clock.t += 5.0
        for t in tickets:
            ac.release(t, 300)
    snap = ac.snapshot()
    assert snap.remote.waiting_prefill_tokens == 0 and snap.ttft_target_s == 2.0
    assert snap.remote.prefill_tokens_per_s == pytest.approx(400 / 2.0)  # the 10 idle seconds do not count
    assert snap.local.prefill_tokens_per_s is None  # nothing measured for LOCAL yet


def test_prefill_rate_needs_samples_and_forgets_old_ones():
    clock = FakeClock()
    ac = AdmissionController(AdmissionConfig(), window_s=10.0, clock=clock)
    tickets = [ac.admit(Route.LOCAL, 50, prefill_tokens=40) for _ in range(3)]
    clock.t += 0.5
    for t in tickets:
        ac.first_token(t)
    assert ac.snapshot().local.prefill_tokens_per_s is None  # 3 < MIN_PREFILL_SAMPLES
    late = ac.admit(Route.LOCAL, 50, prefill_tokens=40)
    clock.t += 0.5
    ac.first_token(late)
    assert ac.snapshot().local.prefill_tokens_per_s == pytest.approx(160 / 1.0)
    clock.t += 30
    assert ac.snapshot().local.prefill_tokens_per_s is None


def test_request_ended_before_its_first_token_leaves_the_queue_unmeasured():
    clock = FakeClock()
    ac = AdmissionController(AdmissionConfig(), clock=clock)
    t = ac.admit(Route.REMOTE, 500, prefill_tokens=400)
    clock.t += 3
    ac.release(t, 0, reached_first_token=False)  # cancelled while waiting
    snap = ac.snapshot()
    assert snap.remote.waiting_prefill_tokens == 0 and snap.remote.inflight_requests == 0
    assert snap.remote.prefill_tokens_per_s is None


def test_token_pace_follows_recent_gaps_and_forgets_a_quiet_edge():
    clock = FakeClock()
    ac = AdmissionController(AdmissionConfig(), clock=clock, tpot_target_s=0.2)
    assert ac.snapshot().seconds_per_token is None
    ac.tokens_streamed(0.1)
    assert ac.snapshot().seconds_per_token == pytest.approx(0.1) and ac.snapshot().tpot_target_s == 0.2
    for _ in range(20):  # the streams slow to 0.4 s per token: past the target within a few seconds
        clock.t += 0.25
        ac.tokens_streamed(0.4)
    assert ac.snapshot().seconds_per_token > 0.2
    for _ in range(80):  # ... and the average reaches the new pace
        clock.t += 0.25
        ac.tokens_streamed(0.4)
    assert ac.snapshot().seconds_per_token == pytest.approx(0.4, rel=0.01)
    clock.t += 11.0  # nothing streamed for longer than the pace is kept
    assert ac.snapshot().seconds_per_token is None


def test_long_prefill_steps_do_not_read_as_slow_streams():
    """Long prompts joining the batch stall every stream for one step; the streams' time per token (what TPOT
    counts) stays far under the target, and so must the pace admission compares with it."""
    clock = FakeClock()
    ac = AdmissionController(AdmissionConfig(), clock=clock, tpot_target_s=0.2)
    worst = 0.0
    for step in range(390):  # 16 streams at 40 ms per token, and every 13th step a 500 ms prefill step
        gap = 0.5 if step % 13 == 12 else 0.04
        clock.t += gap
        for _ in range(16):
            ac.tokens_streamed(gap)
        if step > 26:
            worst = max(worst, ac.snapshot().seconds_per_token)
    # 13 tokens a second: 77 ms per token. (A time-weighted average of the gaps read 0.27 s here.)
    assert 0.06 < worst < 0.1, worst


def test_retry_appointments_are_spaced_held_kept_and_lapse():
    from router.admission import RetryAppointments

    book = RetryAppointments(grace_s=1.5, horizon_s=10.0)
    assert [book.book(101.0, 0.5, 100.0) for _ in range(3)] == [101.0, 101.5, 102.0]  # spaced by the finish rate
    assert book.book(120.0, 0.5, 100.0) == 120.0  # past the horizon: advice, not held ...
    assert book.book(100.0, 0.5, 100.0) == 102.5  # ... so the next is spaced after 102.0, not after 120
    assert not book.due(100.5)
    assert book.due(101.0)  # the first is due: the room is held for it
    book.keep(101.2)  # its client came back
    assert book.due(101.6)  # the second one's time has come
    assert not book.due(104.1)  # ... and the rest lapsed 1.5 s after their times
    assert book.book(104.1, 0.0, 104.1) == 104.1  # nothing is held any more


def test_appointments_follow_the_edge_finish_rate():
    clock = FakeClock()
    ac = AdmissionController(AdmissionConfig(max_retry_after_s=30), window_s=10.0, clock=clock)
    for _ in range(20):  # 20 requests finished in the last 10 s: 2 per second
        ac.release(ac.admit(Route.LOCAL, 10))
    assert ac.requests_per_s() == 2.0
    assert [ac.appointment(1.0) for _ in range(3)] == [1.0, 1.5, 2.0]
