"""The pools' autoscaling decisions and Serve policy classes, on constructed contexts (no Ray cluster)."""

import logging
import math
import warnings

from ray.serve._private.common import TimeStampedValue
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from cluster.serving.autoscaling import (
    DecodeAutoscalingPolicy,
    PrefillAutoscalingPolicy,
    Sample,
    decode_desired_replicas,
    peak,
    prefill_desired_replicas,
    queue_trend,
    replica_env,
    serve_autoscaling_config,
)
from cluster.serving.config import AutoscalingThresholds

T = AutoscalingThresholds(
    min_replicas=1,
    max_replicas=4,
    target_queued_prefill_tokens_per_replica=1000,
    kv_usage_scale_up=0.8,
    kv_usage_scale_down=0.3,
    target_running_seqs_per_replica=10,
    spike_window_s=5,
    trend_window_s=10,
    replica_startup_s=20,
)
NOW = 1_000_000.0


def test_prefill_scaling_by_queued_tokens():
    assert prefill_desired_replicas(1, 0, T) == 1
    assert prefill_desired_replicas(1, 2500, T) == 3
    assert prefill_desired_replicas(2, 99999, T) == 4


def test_decode_scaling_by_kv_use_and_sequences():
    assert decode_desired_replicas(2, 0.9, 5, T) == 3  # KV pressure
    assert decode_desired_replicas(1, 0.5, 35, T) == 4  # sequences outgrow the target
    assert decode_desired_replicas(3, 0.1, 5, T) == 2  # idle: down by one
    assert decode_desired_replicas(2, 0.5, 15, T) == 2  # in the band: stay
    assert decode_desired_replicas(1, 0.1, 0, T) == 1  # never below min
    assert decode_desired_replicas(4, 0.99, 80, T) == 4  # never above max


def test_trend_and_peak():
    rising = [Sample(NOW - 10 + i, 100.0 * i) for i in range(11)]
    assert math.isclose(queue_trend(rising, 10), 100.0)
    assert math.isclose(queue_trend(rising, 3), 100.0)  # the window ends at the latest sample
    assert queue_trend(rising[-2:], 10) == 0.0  # too few samples to call it a trend
    assert peak([Sample(NOW - 20, 0.99), Sample(NOW - 1, 0.5)], 5) == 0.5  # the old spike is over
    # Samples arrive in batches: the window ends at the latest one, however late it reached the controller.
    assert peak([Sample(NOW - 30, 0.2), Sample(NOW - 22, 0.97), Sample(NOW - 20, 0.6)], 5) == 0.97
    assert peak([], 5) == 0.0


def context(current: int, metrics: dict[str, list[list[tuple[float, float]]]]) -> AutoscalingContext:
    """Serve's own context, with every replica's samples as Serve keeps them and their look-back means."""
    raw = {
        name: {f"replica-{i}": [TimeStampedValue(ts, v) for ts, v in series] for i, series in enumerate(per_replica)}
        for name, per_replica in metrics.items()
    }
    means = {
        name: {r: sum(s.value for s in series) / len(series) for r, series in by_replica.items()}
        for name, by_replica in raw.items()
    }
    return AutoscalingContext(
        deployment_id=None,
        deployment_name="pool",
        app_name="shapeserve",
        current_num_replicas=current,
        target_num_replicas=current,
        running_replicas=[],
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=means,
        raw_metrics=raw,
        capacity_adjusted_min_replicas=T.min_replicas,
        capacity_adjusted_max_replicas=T.max_replicas,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=NOW,
        config=None,
    )


def series(values, period_s=0.5):
    """Samples every ``period_s`` ending now."""
    return [(NOW - period_s * (len(values) - 1 - i), float(v)) for i, v in enumerate(values)]


def test_prefill_scales_before_the_queue_peaks_on_a_rising_arrival_rate():
    policy = PrefillAutoscalingPolicy(**T.model_dump())
    # 600 queued tokens now (one replica's target is 1000), growing 100 tokens/s: in the 20 s a new replica needs
    # to start, 2600 would be queued.
    rising = series([100 + 50 * i for i in range(11)])
    assert policy(context(1, {"queued_prefill_tokens": [rising]}))[0] == 3
    # The same queue, flat: one replica carries it.
    assert policy(context(1, {"queued_prefill_tokens": [series([600] * 11)]}))[0] == 1
    # A draining queue is not extrapolated down; the queue itself decides.
    assert policy(context(2, {"queued_prefill_tokens": [series([3000 - 250 * i for i in range(11)])]}))[0] == 1


def test_prefill_does_not_flap_on_a_noisy_flat_queue():
    policy = PrefillAutoscalingPolicy(**T.model_dump())
    noise = [500 + (150 if (i * 7) % 3 == 0 else -120) + 40 * ((i * 5) % 4) for i in range(120)]
    decisions = {
        policy(context(1, {"queued_prefill_tokens": [series(noise[end - 20 : end])]}))[0] for end in range(20, 120)
    }
    assert decisions == {1}


def test_decode_sees_a_spike_that_the_look_back_mean_hides():
    policy = DecodeAutoscalingPolicy(**T.model_dump())
    kv = series([0.4] * 56 + [0.95] * 4)  # 28 s at 0.4, then 2 s at 0.95: the 30 s mean is 0.44
    seqs = series([8] * 60)
    ctx = context(1, {"kv_usage": [kv], "running_seqs": [seqs]})
    assert sum(ctx.aggregated_metrics["kv_usage"].values()) < T.kv_usage_scale_down + 0.2
    assert policy(ctx)[0] == 2


def test_decode_holds_in_the_band_and_scales_down_when_idle():
    policy = DecodeAutoscalingPolicy(**T.model_dump())
    wobble = [0.35 + 0.4 * ((i * 3) % 5) / 4 for i in range(80)]  # 0.35 .. 0.75, never past a threshold
    for end in range(20, 80):
        two = [series(wobble[end - 20 : end]), series(wobble[end - 20 : end][::-1])]
        ctx = context(2, {"kv_usage": two, "running_seqs": [series([7] * 20), series([7] * 20)]})
        assert policy(ctx)[0] == 2
    idle = context(3, {"kv_usage": [series([0.1] * 20)] * 3, "running_seqs": [series([1] * 20)] * 3})
    assert policy(idle)[0] == 2  # one at a time
    full = context(4, {"kv_usage": [series([0.99] * 20)] * 4, "running_seqs": [series([60] * 20)] * 4})
    assert policy(full)[0] == 4  # the bound holds


def test_decisions_are_logged_with_their_inputs(caplog):
    policy = PrefillAutoscalingPolicy(**T.model_dump())
    rising = {"queued_prefill_tokens": [series([100 + 50 * i for i in range(11)])]}
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        for _ in range(5):  # Serve asks every tick while the decision waits out its delay: logged once
            policy(context(1, rising))
        policy(context(1, {"queued_prefill_tokens": [series([10] * 11)]}))  # no change: nothing logged
    (record,) = [r for r in caplog.records if "autoscaling" in r.getMessage()]
    assert "prefill pool: 1 -> 3 replicas (queued prefill tokens 600, trend +100/s, predicted 2600 in 20 s" in (
        record.getMessage()
    )


class AggregatedOnly:
    """A context with look-back means only (what older Serve versions give)."""

    def __init__(self, current, metrics):
        self.current_num_replicas = current
        self.aggregated_metrics = metrics
        self.raw_metrics = None
        self.current_time = NOW


def test_policy_classes_read_means_when_no_raw_series():
    p = PrefillAutoscalingPolicy(**T.model_dump())
    assert p(AggregatedOnly(1, {"queued_prefill_tokens": {"a": 1500.0, "b": 900.0}}))[0] == 3
    assert p(AggregatedOnly(2, {}))[0] == 2
    d = DecodeAutoscalingPolicy(**T.model_dump())
    assert d(AggregatedOnly(2, {"kv_usage": {"a": 0.95, "b": 0.85}, "running_seqs": {"a": 3.0, "b": 3.0}}))[0] == 3


def test_serve_config_of_a_pool():
    cfg = serve_autoscaling_config("decode", T)
    assert cfg["policy"]["policy_function"] is DecodeAutoscalingPolicy and cfg["max_replicas"] == 4
    assert cfg["look_back_period_s"] == 15  # Serve keeps the samples the policies read, longer than its interval
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # Serve warns it will refuse a look-back <= its interval
        AutoscalingConfig(**cfg)
    assert replica_env(T) == {
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1.0",
        "RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR": str(1 / 15),  # a sample every push interval
    }
