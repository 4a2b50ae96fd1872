"""Admission counts, drain rate, and the prefix estimator (no Ray)."""

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
