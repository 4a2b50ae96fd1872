"""The geometry classifier: exact decisions for exact inputs (no Ray, no model)."""

import pytest

from cluster.serving.config import AdmissionConfig, ClassBudget, ClassifierConfig
from router.classifier import ClassLoad, LoadSnapshot, RequestGeometry, Route, classify, route_class

CFG = ClassifierConfig(local_max_uncached_tokens=32, high_priority=1, priority_headroom=0.5)
ADM = AdmissionConfig(
    local=ClassBudget(max_inflight_requests=4, max_inflight_tokens=1000),
    remote=ClassBudget(max_inflight_requests=2, max_inflight_tokens=500),
    min_retry_after_s=1,
    max_retry_after_s=30,
)


def geo(prompt=100, cached=0, max_tokens=16, fmt="float32", priority=0):
    return RequestGeometry(prompt, cached, max_tokens, fmt, priority)


def test_short_prompt_is_local():
    d = classify(geo(prompt=32), CFG, ADM, LoadSnapshot())
    assert (d.route, d.route_class, d.retry_after_s) == (Route.LOCAL, Route.LOCAL, None)


def test_long_prompt_is_remote():
    d = classify(geo(prompt=33), CFG, ADM, LoadSnapshot())
    assert d.route is Route.REMOTE


def test_cached_prefix_makes_long_prompt_local():
    assert classify(geo(prompt=200, cached=168), CFG, ADM, LoadSnapshot()).route is Route.LOCAL
    assert classify(geo(prompt=200, cached=167), CFG, ADM, LoadSnapshot()).route is Route.REMOTE
    # a cache estimate larger than the prompt counts as zero uncached tokens
    assert geo(prompt=10, cached=50).uncached_tokens == 0


def test_kv_format_not_transferable_is_local():
    cfg = ClassifierConfig(local_max_uncached_tokens=32, remote_kv_formats=("bfloat16",))
    assert classify(geo(prompt=500, fmt="float32"), cfg, ADM, LoadSnapshot()).route is Route.LOCAL
    assert classify(geo(prompt=500, fmt="bfloat16"), cfg, ADM, LoadSnapshot()).route is Route.REMOTE


def test_no_prefill_replica_is_local():
    assert route_class(geo(prompt=500), CFG, prefill_available=False)[0] is Route.LOCAL


def test_idle_class_admits_oversized_request():
    assert classify(geo(prompt=5000, max_tokens=100), CFG, ADM, LoadSnapshot()).route is Route.REMOTE


def test_reject_when_request_budget_full():
    load = LoadSnapshot(remote=ClassLoad(inflight_requests=2, inflight_tokens=200, tokens_per_s=20.0))
    d = classify(geo(prompt=100, max_tokens=16), CFG, ADM, load)
    assert d.route is Route.REJECT and d.route_class is Route.REMOTE
    # one average request (200/2 = 100 tokens) at 20 tok/s -> 5 s
    assert d.retry_after_s == 5
    assert "requests" in d.reason


def test_reject_when_token_budget_full_and_wait_from_excess():
    load = LoadSnapshot(remote=ClassLoad(inflight_requests=1, inflight_tokens=450, tokens_per_s=10.0))
    d = classify(geo(prompt=100, max_tokens=16), CFG, ADM, load)
    # excess = 450 + 116 - 500 = 66 tokens at 10 tok/s -> ceil(6.6) = 7
    assert (d.route, d.retry_after_s) == (Route.REJECT, 7)
    assert "tokens" in d.reason


def test_retry_after_is_clamped():
    slow = LoadSnapshot(remote=ClassLoad(inflight_requests=2, inflight_tokens=500, tokens_per_s=0.01))
    assert classify(geo(), CFG, ADM, slow).retry_after_s == 30
    fast = LoadSnapshot(remote=ClassLoad(inflight_requests=2, inflight_tokens=10, tokens_per_s=1e6))
    assert classify(geo(), CFG, ADM, fast).retry_after_s == 1


def test_local_budget_is_separate_from_remote():
    load = LoadSnapshot(remote=ClassLoad(inflight_requests=2, inflight_tokens=500, tokens_per_s=1.0))
    assert classify(geo(prompt=10), CFG, ADM, load).route is Route.LOCAL
    full_local = LoadSnapshot(local=ClassLoad(inflight_requests=4, inflight_tokens=40, tokens_per_s=1.0))
    d = classify(geo(prompt=10), CFG, ADM, full_local)
    assert (d.route, d.route_class) == (Route.REJECT, Route.LOCAL)


@pytest.mark.parametrize("priority,expected", [(0, Route.REJECT), (1, Route.REMOTE), (5, Route.REMOTE)])
def test_high_priority_uses_headroom(priority, expected):
    # remote budget 2 requests; with headroom 0.5 a high-priority request may be the 3rd
    load = LoadSnapshot(remote=ClassLoad(inflight_requests=2, inflight_tokens=100, tokens_per_s=10.0))
    assert classify(geo(priority=priority), CFG, ADM, load).route is expected


def test_classify_is_pure():
    load = LoadSnapshot(remote=ClassLoad(1, 100, 5.0))
    g = geo()
    assert classify(g, CFG, ADM, load) == classify(g, CFG, ADM, load)
    assert load == LoadSnapshot(remote=ClassLoad(1, 100, 5.0))
