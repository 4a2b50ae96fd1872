"""The pools' autoscaling decisions and Serve policy classes, on constructed contexts (no Ray cluster)."""

import logging
import math
import warnings

from ray.serve._private.common import DeploymentID, TimeStampedValue
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from cluster.serving.autoscaling import (
    DECODE_DEPLOYMENT,
    PREFILL_DEPLOYMENT,
    ApplicationAutoscalingPolicy,
    DecodeAutoscalingPolicy,
    PrefillAutoscalingPolicy,
    Sample,
    counter_increase,
    decode_desired_replicas,
    peak,
    prefill_desired_replicas,
    queue_trend,
    read_policy_kwargs,
    replica_env,
    replica_startup,
    serve_autoscaling_config,
)
from cluster.serving.config import AutoscalingThresholds, PoolRatioConfig
from cluster.serving.messages import DecodeAutoscalingStats, PrefillAutoscalingStats
from cluster.serving.pool_ratio import ClassMix, RatioBand, needed_ratio, next_band

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


def context(
    current: int,
    metrics: dict[str, list[list[tuple[float, float]]]],
    config: AutoscalingConfig | None = None,
    name: str = "pool",
) -> AutoscalingContext:
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
        deployment_id=DeploymentID(name=name, app_name="shapeserve"),
        deployment_name=name,
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
        config=config,
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
    assert (
        "prefill pool: 1 -> 3 replicas (queued prefill tokens 600, trend +100/s, predicted 2600 in 20 s (configured "
        "start-up); target 1000 per replica)" in record.getMessage()
    )


def test_prefill_looks_ahead_by_the_measured_start_up():
    assert replica_startup([], T) == (20, False)  # nothing measured yet: the configured value
    assert replica_startup([0.0], T) == (20, False)  # a replica that has not measured reports 0
    assert replica_startup([4.5, 7.25], T) == (7.25, True)  # the slowest start is the one to plan for
    assert replica_startup([3600.0], T) == (T.max_replica_startup_s, True)  # a long-lived process: capped
    # New replicas wait for a node to start, which no replica can measure: the operator's floor.
    waits = T.model_copy(update={"min_replica_startup_s": 90.0})
    assert replica_startup([7.25], waits) == (90.0, True)
    policy = PrefillAutoscalingPolicy(**T.model_dump())
    rising = series([100 + 50 * i for i in range(11)])  # 600 queued, +100 tokens/s
    # Replicas that start in 5 s: 1100 queued by then, two replicas (20 s configured would have asked for three).
    measured = context(1, {"queued_prefill_tokens": [rising], "startup_s": [series([5.0] * 11)]})
    assert policy(measured)[0] == 2
    assert policy(context(1, {"queued_prefill_tokens": [rising]}))[0] == 3


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


def test_ratio_kwargs_ride_with_each_pool_and_lengthen_the_look_back():
    r = PoolRatioConfig(mix_window_s=40)
    cfg = serve_autoscaling_config("prefill", T, r)
    assert read_policy_kwargs(cfg["policy"]["policy_kwargs"]) == (T, r)
    assert cfg["look_back_period_s"] == 40  # Serve keeps the whole mix window of samples
    AutoscalingConfig(**cfg)
    assert PrefillAutoscalingPolicy(**cfg["policy"]["policy_kwargs"]).t == T  # the per-pool policy ignores it
    assert replica_env(T, r)["RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR"] == str(1 / 40)


# ---- the prefill:decode ratio (application-level policy) ------------------------------------------------------

PT = AutoscalingThresholds(
    min_replicas=1,
    max_replicas=8,
    target_queued_prefill_tokens_per_replica=1000,
    upscale_delay_s=0,
    downscale_delay_s=0,
)
DT = AutoscalingThresholds(
    min_replicas=1,
    max_replicas=8,
    target_running_seqs_per_replica=8,
    kv_usage_scale_up=0.8,
    kv_usage_scale_down=0.3,
    upscale_delay_s=0,
    downscale_delay_s=0,
)
R = PoolRatioConfig(min_prefill_per_decode=0.1, max_prefill_per_decode=4, band=0.25, mix_window_s=30)


def test_needed_ratio_from_the_mix():
    # 12000 REMOTE prompt tokens/s at 2000/s per prefill replica: 6 prefill replicas; 32 sequences at 8 per replica:
    # 4 decode replicas.
    long_prompts = ClassMix(12000, running_seqs=32, kv_in_use=2.0, prefill_tokens_per_s=2000)
    assert needed_ratio(long_prompts, DT, R) == 1.5
    # Long prompts fill KV before sequences: 4.0 replicas' worth of KV at 0.8 per replica is 5 decode replicas.
    assert needed_ratio(ClassMix(12000, 32, 4.0, 2000), DT, R) == 6 / 5
    chat = ClassMix(200, running_seqs=32, kv_in_use=2.0, prefill_tokens_per_s=2000)
    assert needed_ratio(chat, DT, R) == R.min_prefill_per_decode  # 0.025, bounded below
    assert needed_ratio(ClassMix(0, 32, 2.0, None), DT, R) == R.min_prefill_per_decode  # all LOCAL
    assert needed_ratio(ClassMix(12000, 0.1, 0.0, 2000), DT, R) == R.max_prefill_per_decode  # bounded above
    assert needed_ratio(ClassMix(12000, 32, 2.0, None), DT, R) is None  # prefill throughput not measured yet
    assert needed_ratio(ClassMix(0, 0, 0.0, 2000), DT, R) is None  # no traffic


def test_the_band_moves_only_when_the_needed_ratio_leaves_it():
    band = next_band(None, 1.5, R)
    assert band == RatioBand(1.5, 1.2, 1.875)
    assert next_band(band, 1.25, R) is band and next_band(band, 1.85, R) is band
    assert next_band(band, None, R) is band  # no traffic: kept
    assert next_band(band, 2.0, R) == RatioBand(2.0, 1.6, 2.5)
    # The band times the decode replicas, rounded outwards: a ratio is kept to within one replica.
    assert band.prefill_range(4) == (4, 8)
    assert RatioBand(1.0, 0.8, 1.25).prefill_range(4) == (3, 5)
    assert RatioBand(0.1, 0.08, 0.125).prefill_range(4) == (0, 1)
    assert RatioBand(0.7, 0.1 + 0.2, 0.7).prefill_range(10) == (3, 7)  # float noise on an exact product


def test_counter_increase_reads_a_window_of_a_counter():
    counter = [Sample(NOW - 40 + i, 100.0 * i) for i in range(41)]
    assert counter_increase(counter, 30) == (3000.0, 30.0)
    assert counter_increase(counter[:1], 30) is None  # one sample: no rate yet


def timeline(samples) -> dict[str, list[tuple[float, float]]]:
    """One replica's autoscaling samples, one a second ending now, per metric as Serve keeps them."""
    out: dict[str, list[tuple[float, float]]] = {}
    for i, sample in enumerate(samples):
        for name, value in sample.as_dict().items():
            out.setdefault(name, []).append((NOW - (len(samples) - 1 - i), value))
    return out


def pool_context(name: str, current: int, replicas, t: AutoscalingThresholds, r: PoolRatioConfig | None = R):
    metrics: dict[str, list[list[tuple[float, float]]]] = {}
    for replica in replicas:
        for metric, values in timeline(replica).items():
            metrics.setdefault(metric, []).append(values)
    pool = "prefill" if name == PREFILL_DEPLOYMENT else "decode"
    return context(current, metrics, AutoscalingConfig(**serve_autoscaling_config(pool, t, r)), name)


def prefill_replica(queued=500.0, tokens_per_s=2000.0, busy=1.0, n=31, noise=lambda i: 1.0):
    """A prefill replica's samples: ``queued`` tokens, prefilling ``tokens_per_s`` while busy ``busy`` of the time."""
    done = [sum(noise(k) for k in range(i)) for i in range(n)]
    return [PrefillAutoscalingStats(queued, tokens_per_s * busy * d, busy * d, 12.0) for d in done]


def decode_replica(remote_tokens_per_s=3000.0, running=8.0, kv=0.5, n=31, noise=lambda i: 1.0):
    handed = [remote_tokens_per_s * sum(noise(k) for k in range(i)) for i in range(n)]
    return [DecodeAutoscalingStats(kv, running, h) for h in handed]


def app(prefill_current, decode_current, prefill_replicas, decode_replicas, pt=PT, dt=DT, r=R):
    contexts = [
        pool_context(PREFILL_DEPLOYMENT, prefill_current, prefill_replicas, pt, r),
        pool_context(DECODE_DEPLOYMENT, decode_current, decode_replicas, dt, r),
    ]
    return {ctx.deployment_id: ctx for ctx in contexts}


def decide(policy, contexts) -> tuple[int, int]:
    decisions, _state = policy(contexts)
    by_name = {deployment.name: n for deployment, n in decisions.items()}
    return by_name[PREFILL_DEPLOYMENT], by_name[DECODE_DEPLOYMENT]


# 4 decode replicas each handing over 3000 REMOTE prompt tokens/s with 8 running sequences; prefill replicas
# prefill 2000 tokens per busy second: the mix needs 6 prefill replicas for 4 decode ones (1.5).
LONG_PROMPTS = [decode_replica(3000.0)] * 4
# 50 REMOTE prompt tokens/s each beside the same sequences: 0.1 prefill replicas for 4 decode ones.
CHAT = [decode_replica(50.0)] * 4


def test_a_long_prompt_mix_pulls_prefill_up_with_decode(caplog):
    policy = ApplicationAutoscalingPolicy()
    # The prefill queue is still short (one replica's worth): its own policy would stay at 1.
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        assert decide(policy, app(1, 4, [prefill_replica()], LONG_PROMPTS)) == (4, 4)
    (line,) = [r.getMessage() for r in caplog.records if "autoscaling" in r.getMessage()]
    assert line == (
        "autoscaling prefill pool: 1 -> 4 replicas (queued prefill tokens 500, trend +0/s, predicted 500 in 12 s "
        "(measured start-up); target 1000 per replica; 1 -> 4: prefill:decode band 1.20-1.88, 4-8 prefill "
        "replicas for 4 decode (the mix needs 1.50: REMOTE prompts 12000 tokens/s at 2000/s per prefill replica, "
        "the load of 4.0 decode replicas))"
    )
    # Half as much traffic again, same mix: decode on its way to 6, and prefill follows at once, before its queue
    # shows the load.
    more = [decode_replica(4500.0, running=12)] * 4
    assert decide(policy, app(4, 4, [prefill_replica()] * 4, more)) == (7, 6)


def test_a_chat_mix_keeps_a_prefill_burst_to_what_the_mix_needs():
    # Three prefill replicas with 900 queued tokens each: their own policy holds 3.
    burst = [prefill_replica(queued=900.0, busy=0.05)] * 3
    assert decide(ApplicationAutoscalingPolicy(), app(3, 4, burst, CHAT)) == (1, 4)
    # The same burst beside a long-prompt mix: the band asks for more, not fewer.
    assert decide(ApplicationAutoscalingPolicy(), app(3, 4, burst, LONG_PROMPTS)) == (4, 4)
    # Without a pool_ratio in the ServeConfig, each pool decides alone.
    assert decide(ApplicationAutoscalingPolicy(), app(3, 4, burst, CHAT, r=None)) == (3, 4)


def test_the_pools_bounds_win_over_the_band():
    few = PT.model_copy(update={"max_replicas": 3})
    assert decide(ApplicationAutoscalingPolicy(), app(1, 4, [prefill_replica()], LONG_PROMPTS, pt=few)) == (3, 4)
    floor = PT.model_copy(update={"min_replicas": 2})
    assert decide(ApplicationAutoscalingPolicy(), app(3, 4, [prefill_replica(busy=0.05)] * 3, CHAT, pt=floor)) == (2, 4)
    # Decode held at its maximum under the load of 10 replicas (mix: 1.2 prefill per decode replica): prefill is
    # kept beside the 4 decode replicas there (3-6), not the 10 the load asks for.
    capped = DT.model_copy(update={"max_replicas": 4})
    crowded = [decode_replica(6000.0, running=20)] * 4
    assert decide(ApplicationAutoscalingPolicy(), app(1, 4, [prefill_replica()], crowded, dt=capped)) == (3, 4)


def jitter(i: int) -> float:
    """0.5x .. 1.5x the mean rate, second by second."""
    return 0.5 + ((i * 7919) % 101) / 100


def test_no_flapping_on_a_noisy_mix():
    # REMOTE traffic swings +-15% over a minute on top of the jitter: the needed ratio, read over the 30 s window,
    # wanders over 1.36-1.64, which beside 4 decode replicas is 4 or 5 prefill replicas at the band's lower edge.
    # Re-centred on every reading the band would move prefill between 4 and 5 over and over (7 times in this run).
    def swing(i: int) -> float:
        return (1 + 0.15 * math.sin(2 * math.pi * i / 60)) * jitter(i)

    decode_history = decode_replica(3000.0, n=200, noise=swing)
    prefill_history = prefill_replica(n=200, noise=lambda i: jitter(i + 13))
    policy = ApplicationAutoscalingPolicy()
    decisions, bands = set(), set()
    for end in range(31, 200):  # Serve's look-back slides one sample a tick
        prefill = [prefill_history[end - 31 : end]]
        decode = [decode_history[end - 31 : end]] * 4
        decisions.add(decide(policy, app(4, 4, prefill, decode)))
        bands.add(policy.band)
    assert len(decisions) == 1 and len(bands) == 1
    ((prefill_replicas, decode_replicas),) = decisions
    assert 4 <= prefill_replicas <= 5 and decode_replicas == 4


def test_no_traffic_holds_the_band_and_leaves_each_pool_to_its_own_load(caplog):
    idle_prefill = [prefill_replica(queued=0.0, busy=0.0)]
    idle_decode = [decode_replica(0.0, running=0.0, kv=0.0)]
    policy = ApplicationAutoscalingPolicy()
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        assert decide(policy, app(1, 1, idle_prefill, idle_decode)) == (1, 1)
    assert policy.band is None and not [r for r in caplog.records if "autoscaling" in r.getMessage()]
    assert decide(policy, app(1, 4, [prefill_replica()], LONG_PROMPTS)) == (4, 4)
    band = policy.band
    # Traffic stops: the band stays for its return, and each pool shrinks on its own load (decode one at a time).
    assert decide(policy, app(4, 4, idle_prefill * 4, idle_decode * 4)) == (1, 3)
    assert policy.band is band
    # It returns with decode at 3 and prefill at 1: prefill comes back beside decode at once.
    assert decide(policy, app(1, 3, [prefill_replica()], LONG_PROMPTS[:3])) == (3, 3)


def test_serve_runs_the_application_policy_from_its_import_path():
    # What the controller does with a Serve config's ``autoscaling_policy``: import, pickle by value, instantiate
    # once, and wrap it in its per-deployment delays and bounds.
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config
    from ray.serve.config import AutoscalingPolicy

    spec = AutoscalingPolicy(policy_function="cluster.serving.autoscaling:ApplicationAutoscalingPolicy")
    policy = _apply_app_level_autoscaling_config(_resolve_policy_callable(spec))
    assert decide(policy, app(1, 4, [prefill_replica()], LONG_PROMPTS)) == (4, 4)
    slow = PT.model_copy(update={"upscale_delay_s": 30})
    assert decide(policy, app(1, 4, [prefill_replica()], LONG_PROMPTS, pt=slow)) == (1, 4)  # Serve's delay holds it
