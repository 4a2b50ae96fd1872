"""The geometry classifier: exact decisions for exact inputs (no Ray, no model)."""

import dataclasses

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


def test_refused_when_the_prompts_waiting_ahead_would_miss_the_ttft_target():
    big = AdmissionConfig(min_retry_after_s=1, max_retry_after_s=30)  # budgets out of the way
    # 1000 prompt tokens/s measured; 1500 waiting: a 100-token prompt would see its first token in 1.6 s.
    busy = ClassLoad(inflight_requests=5, inflight_tokens=3000, waiting_prefill_tokens=1500, prefill_tokens_per_s=1000)
    ok = classify(geo(prompt=100), CFG, big, LoadSnapshot(remote=busy, ttft_target_s=2.0))
    assert ok.route is Route.REMOTE
    late = classify(geo(prompt=600), CFG, big, LoadSnapshot(remote=busy, ttft_target_s=2.0))
    assert late.route is Route.REJECT and late.route_class is Route.REMOTE
    assert "predicted time to first token 2.1 s is past the 2.0 s target" in late.reason
    assert late.retry_after_s == 1  # 0.1 s of backlog past the target, rounded up
    slow = dataclasses.replace(busy, prefill_tokens_per_s=100)  # 21 s predicted: 19 s until it would fit
    assert classify(geo(prompt=600), CFG, big, LoadSnapshot(remote=slow, ttft_target_s=2.0)).retry_after_s == 19
    # High priority gets the headroom on the target too; LOCAL is judged on its own queue.
    assert (
        classify(geo(prompt=600, priority=1), CFG, big, LoadSnapshot(remote=busy, ttft_target_s=2.0)).route
        is Route.REMOTE
    )
    assert classify(geo(prompt=10), CFG, big, LoadSnapshot(remote=busy, ttft_target_s=2.0)).route is Route.LOCAL


def test_no_ttft_refusal_without_a_target_a_measured_rate_or_a_queue():
    big = AdmissionConfig()
    waiting = ClassLoad(inflight_requests=5, waiting_prefill_tokens=10**6, prefill_tokens_per_s=10.0)
    assert classify(geo(prompt=600), CFG, big, LoadSnapshot(remote=waiting)).route is Route.REMOTE  # no target
    unmeasured = dataclasses.replace(waiting, prefill_tokens_per_s=None)
    assert classify(geo(prompt=600), CFG, big, LoadSnapshot(remote=unmeasured, ttft_target_s=1.0)).route is Route.REMOTE
    idle = dataclasses.replace(waiting, waiting_prefill_tokens=0)
    # nothing waits: even a prompt whose own prefill takes longer than the target is admitted
    assert classify(geo(prompt=600), CFG, big, LoadSnapshot(remote=idle, ttft_target_s=1.0)).route is Route.REMOTE


def test_refused_while_the_streams_run_slower_than_the_tpot_target():
    big = AdmissionConfig(min_retry_after_s=1, max_retry_after_s=30)
    running = ClassLoad(inflight_requests=4, inflight_tokens=2000, tokens_per_s=100.0)
    slow = LoadSnapshot(local=running, tpot_target_s=0.2, seconds_per_token=0.25)
    d = classify(geo(prompt=10), CFG, big, slow)
    assert d.route is Route.REJECT and "250 ms per token, past the 200 ms target" in d.reason
    assert d.retry_after_s == 5  # one average admitted request (500 tokens) at the class's 100 tokens/s
    # a REMOTE request is refused too, its wait read from the class that runs
    assert classify(geo(prompt=100), CFG, big, slow).route is Route.REJECT
    on_pace = dataclasses.replace(slow, seconds_per_token=0.15)
    assert classify(geo(prompt=10), CFG, big, on_pace).route is Route.LOCAL
    # high priority gets the headroom; an idle edge admits whatever pace it last saw
    assert classify(geo(prompt=10, priority=1), CFG, big, slow).route is Route.LOCAL
    assert classify(geo(prompt=10), CFG, big, dataclasses.replace(slow, local=ClassLoad())).route is Route.LOCAL
