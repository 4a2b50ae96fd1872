"""Custom Serve autoscaling policies for the two pools; thresholds come from the ServeConfig.

Each pool replica reports a sample through Serve's ``record_autoscaling_stats`` (``PrefillAutoscalingStats``,
``DecodeAutoscalingStats``); Serve hands a policy every replica's recent samples (``raw_metrics``) and their
look-back means. The decisions are pure functions of those numbers and an ``AutoscalingThresholds`` (tested
without Ray); the policy classes adapt them to Serve's ``AutoscalingContext`` (``policy_kwargs`` = the
thresholds, so a config edit changes the policy) and log every change with its inputs.

- Prefill scales ahead of the load: the queue is predicted a replica's start-up ahead from its trend (a
  least-squares slope over ``trend_window_s``), since a replica asked for now only serves that much later. The
  start-up is the longest one the prefill replicas measured (process start to the end of their start-up),
  within ``min_replica_startup_s``..``max_replica_startup_s``; ``replica_startup_s`` until one has reported.
- Decode scales on the peak of KV use and running sequences over ``spike_window_s``: a look-back mean averages
  a short spike away, and a decode replica that runs out of KV blocks preempts.
- Both pools at once (``ApplicationAutoscalingPolicy``, Serve's application-level policy): the two decisions
  above, then the prefill one kept within the prefill:decode band the observed class mix needs
  (``cluster.serving.pool_ratio``; the ServeConfig's ``pool_ratio``). Serve 2.60 registers an
  application-level policy only from a Serve config file (the application's ``autoscaling_policy``, read by
  ``serve deploy`` / ``serve run FILE``): ``serve.run(app)``, what ``shapeserve serve`` calls, deploys with no
  application config, so there each pool scales on its own.

Hysteresis comes from the band between the up and down thresholds and Serve's upscale/downscale delays (Serve
applies them, per deployment, to the application-level policy's decisions too); a replica chosen for
scale-down drains (Serve stops routing to it and waits ``graceful_shutdown_timeout_s`` for its running
requests) before it goes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.serving.config import AutoscalingThresholds, PoolRatioConfig
from cluster.serving.pool_ratio import ClassMix, RatioBand, decode_replicas_needed, keep_ratio, needed_ratio, next_band

log = logging.getLogger("ray.serve")

#: The pools' Serve deployments (``cluster.app`` names them so): how the application-level policy tells them apart.
PREFILL_DEPLOYMENT = "PrefillWorker"
DECODE_DEPLOYMENT = "DecodeWorker"
_POOLS = {PREFILL_DEPLOYMENT: "prefill", DECODE_DEPLOYMENT: "decode"}


@dataclass(frozen=True)
class Sample:
    """One reported value of one replica (Serve's ``TimeStampedValue``: ``timestamp``, ``value``)."""

    timestamp: float
    value: float


@dataclass(frozen=True)
class Decision:
    """A pool's replica count and the inputs it came from (the log line's parenthesis)."""

    desired: int
    why: str


def _clamp(n: int, t: AutoscalingThresholds) -> int:
    return max(t.min_replicas, min(t.max_replicas, n))


def _recent(series: Sequence[Sample], window_s: float) -> list[Sample]:
    """The samples of the ``window_s`` up to the series' latest one. Replicas push their samples in batches
    (Serve's ``metrics_interval_s``), so the window ends at the latest sample, not at the controller's clock."""
    if not series:
        return []
    end = series[-1].timestamp
    return [s for s in series if s.timestamp >= end - window_s]


def queue_trend(series: Sequence[Sample], window_s: float) -> float:
    """Least-squares slope (units per second) of the samples of the last ``window_s``; 0 with fewer than 3."""
    recent = _recent(series, window_s)
    if len(recent) < 3:
        return 0.0
    n = len(recent)
    mean_t = sum(s.timestamp for s in recent) / n
    mean_v = sum(s.value for s in recent) / n
    var = sum((s.timestamp - mean_t) ** 2 for s in recent)
    if var == 0:
        return 0.0
    return sum((s.timestamp - mean_t) * (s.value - mean_v) for s in recent) / var


def peak(series: Sequence[Sample], window_s: float) -> float:
    """The largest sample of the last ``window_s`` of the series (0 for none)."""
    return max((s.value for s in _recent(series, window_s)), default=0.0)


def window_mean(series: Sequence[Sample], window_s: float) -> float:
    """The mean of the samples of the last ``window_s`` (0 for none)."""
    recent = _recent(series, window_s)
    return sum(s.value for s in recent) / len(recent) if recent else 0.0


def counter_increase(series: Sequence[Sample], window_s: float) -> tuple[float, float] | None:
    """(increase, seconds) of a counter over the samples of the last ``window_s``; None with fewer than two
    samples apart in time. A replica's counters start at 0 with the replica, and each replica is its own series."""
    recent = _recent(series, window_s)
    if len(recent) < 2 or recent[-1].timestamp <= recent[0].timestamp:
        return None
    return max(0.0, recent[-1].value - recent[0].value), recent[-1].timestamp - recent[0].timestamp


def prefill_desired_replicas(current: int, queued_prefill_tokens: float, t: AutoscalingThresholds) -> int:
    """Replicas so that each carries about ``target_queued_prefill_tokens_per_replica`` queued tokens."""
    return _clamp(math.ceil(queued_prefill_tokens / t.target_queued_prefill_tokens_per_replica), t)


def replica_startup(measured_s: Sequence[float], t: AutoscalingThresholds) -> tuple[float, bool]:
    """(seconds a replica asked for now takes to serve, whether measured): the longest start-up the replicas
    measured (the slowest start is the one to plan for) within [``min_replica_startup_s``,
    ``max_replica_startup_s``], or ``replica_startup_s`` before any replica measured one."""
    known = [s for s in measured_s if s > 0]
    if not known:
        return t.replica_startup_s, False
    return min(t.max_replica_startup_s, max(t.min_replica_startup_s, max(known))), True


def predicted_queue(queued_now: float, trend_tokens_per_s: float, startup_s: float) -> float:
    """The queue when a replica asked for now would start serving (``startup_s`` from now), if it keeps growing as
    it has (a shrinking queue is not extrapolated down: scale-down waits for the queue itself)."""
    return queued_now + max(0.0, trend_tokens_per_s) * startup_s


def decode_desired_replicas(current: int, kv_usage: float, running_seqs: float, t: AutoscalingThresholds) -> int:
    """Up by one above the KV-use threshold (or to what sequences need when they outgrow the target), down by one
    below the lower threshold when the sequences fit one replica fewer; otherwise hold.

    ``kv_usage``: mean over replicas of KV block use (0..1); ``running_seqs``: total running sequences.
    """
    by_seqs = math.ceil(running_seqs / t.target_running_seqs_per_replica)
    if kv_usage > t.kv_usage_scale_up or by_seqs > current:
        return _clamp(max(current + 1, by_seqs), t)
    if kv_usage < t.kv_usage_scale_down and by_seqs < current:
        return _clamp(current - 1, t)
    return _clamp(current, t)


# ---- reading Serve's contexts -----------------------------------------------------------------------------------


def _series(ctx: Any, name: str) -> list[list[Sample]]:
    """Each replica's samples of ``name``, oldest first (Serve's raw metrics); the look-back mean as one sample
    per replica when Serve gives no raw series."""
    raw: Mapping[str, Mapping[Any, Sequence[Any]]] | None = getattr(ctx, "raw_metrics", None)
    if raw and raw.get(name):
        return [
            sorted((Sample(s.timestamp, float(s.value)) for s in series), key=lambda s: s.timestamp)
            for series in raw[name].values()
            if series
        ]
    metrics: Mapping[str, Mapping[Any, float]] | None = ctx.aggregated_metrics
    if not metrics or name not in metrics:
        return []
    return [[Sample(0.0, float(v))] for v in metrics[name].values()]


def prefill_decision(ctx: Any, t: AutoscalingThresholds) -> Decision:
    per_replica = _series(ctx, "queued_prefill_tokens")
    if not per_replica:
        return Decision(_clamp(ctx.current_num_replicas, t), "no load reported yet")
    queued = sum(series[-1].value for series in per_replica)
    trend = sum(queue_trend(series, t.trend_window_s) for series in per_replica)
    startup_s, measured = replica_startup([series[-1].value for series in _series(ctx, "startup_s")], t)
    predicted = predicted_queue(queued, trend, startup_s)
    desired = prefill_desired_replicas(ctx.current_num_replicas, predicted, t)
    why = (
        f"queued prefill tokens {queued:.0f}, trend {trend:+.0f}/s, predicted {predicted:.0f} in {startup_s:.3g} s "
        f"({'measured' if measured else 'configured'} start-up); "
        f"target {t.target_queued_prefill_tokens_per_replica} per replica"
    )
    return Decision(desired, why)


def decode_decision(ctx: Any, t: AutoscalingThresholds) -> Decision:
    usage = _series(ctx, "kv_usage")
    running = _series(ctx, "running_seqs")
    if not usage:
        return Decision(_clamp(ctx.current_num_replicas, t), "no load reported yet")
    window = t.spike_window_s
    kv_peak = sum(peak(series, window) for series in usage) / len(usage)
    seqs_peak = sum(peak(series, window) for series in running)
    desired = decode_desired_replicas(ctx.current_num_replicas, kv_peak, seqs_peak, t)
    why = (
        f"KV use peak {kv_peak:.2f} and running sequences peak {seqs_peak:.0f} over {window:g} s; "
        f"thresholds {t.kv_usage_scale_down}-{t.kv_usage_scale_up}, "
        f"{t.target_running_seqs_per_replica} sequences per replica"
    )
    return Decision(desired, why)


def measure_mix(prefill_ctx: Any, decode_ctx: Any, window_s: float) -> ClassMix | None:
    """Both pools' work over ``window_s`` from their replicas' counters; None while no decode replica has two
    samples of its counter (no rate to read yet, or Serve gave look-back means only)."""
    handed = [counter_increase(s, window_s) for s in _series(decode_ctx, "remote_prompt_tokens")]
    rates = [tokens / seconds for tokens, seconds in filter(None, handed)]
    if not rates:
        return None
    computed = [counter_increase(s, window_s) for s in _series(prefill_ctx, "prompt_tokens")]
    busy = [counter_increase(s, window_s) for s in _series(prefill_ctx, "busy_s")]
    tokens = sum(c[0] for c in computed if c)
    busy_s = sum(b[0] for b in busy if b)
    return ClassMix(
        remote_prompt_tokens_per_s=sum(rates),
        running_seqs=sum(window_mean(s, window_s) for s in _series(decode_ctx, "running_seqs")),
        kv_in_use=sum(window_mean(s, window_s) for s in _series(decode_ctx, "kv_usage")),
        prefill_tokens_per_s=tokens / busy_s if tokens > 0 and busy_s > 0 else None,
    )


# ---- Serve's policies -----------------------------------------------------------------------------------------


def policy_kwargs(t: AutoscalingThresholds, ratio: PoolRatioConfig | None = None) -> dict[str, Any]:
    """A pool deployment's ``policy_kwargs``: its thresholds, and the ServeConfig's ``pool_ratio`` for the
    application-level policy (which reads both from the deployments' configs: one source of truth)."""
    kwargs: dict[str, Any] = t.model_dump()
    if ratio is not None:
        kwargs["pool_ratio"] = ratio.model_dump()
    return kwargs


def read_policy_kwargs(kwargs: Mapping[str, Any]) -> tuple[AutoscalingThresholds, PoolRatioConfig | None]:
    """The inverse of ``policy_kwargs``."""
    thresholds = dict(kwargs)
    ratio = thresholds.pop("pool_ratio", None)
    return AutoscalingThresholds(**thresholds), PoolRatioConfig(**ratio) if ratio is not None else None


class DecisionLog:
    """Logs a pool's decision when it changes (Serve calls a policy about every 0.1 s, and a decision stands
    through Serve's delay and the new replica's start): one line per change, with its inputs."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int]] = {}

    def decided(self, pool: str, current: int, decision: Decision) -> None:
        change = (current, decision.desired)
        if decision.desired == current:
            self._last.pop(pool, None)
            return
        if self._last.get(pool) != change:
            log.info("autoscaling %s pool: %d -> %d replicas (%s)", pool, current, decision.desired, decision.why)
        self._last[pool] = change


class PrefillAutoscalingPolicy:
    """Serve's per-deployment policy of the prefill pool (``policy_function`` = this class, ``policy_kwargs`` =
    ``policy_kwargs(thresholds)``); Serve makes one instance per deployment and calls it every tick."""

    def __init__(self, **kwargs: Any):
        # A ``pool_ratio`` in the kwargs is for the application-level policy: one deployment sees one pool only.
        self.t, _ = read_policy_kwargs(kwargs)
        self._log = DecisionLog()

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        decision = prefill_decision(ctx, self.t)
        self._log.decided("prefill", ctx.current_num_replicas, decision)
        return decision.desired, getattr(ctx, "policy_state", None) or {}


class DecodeAutoscalingPolicy:
    """The decode pool's per-deployment policy (as ``PrefillAutoscalingPolicy``)."""

    def __init__(self, **kwargs: Any):
        self.t, _ = read_policy_kwargs(kwargs)
        self._log = DecisionLog()

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        decision = decode_decision(ctx, self.t)
        self._log.decided("decode", ctx.current_num_replicas, decision)
        return decision.desired, getattr(ctx, "policy_state", None) or {}


@dataclass(frozen=True)
class _Pool:
    """One pool as the application-level policy sees it in a tick."""

    deployment: Any
    ctx: Any
    thresholds: AutoscalingThresholds
    decision: Decision


class ApplicationAutoscalingPolicy:
    """Serve's application-level policy: a Serve config's ``autoscaling_policy: {policy_function:
    cluster.serving.autoscaling:ApplicationAutoscalingPolicy}``. Serve makes one instance per application and calls
    it every tick with the context of every autoscaled deployment; it takes the place of their own policies.

    Each pool decides as its own policy would; with a ``pool_ratio`` and both pools autoscaled, the prefill
    decision is then kept within the band the class mix needs beside the decode replicas there or on their way
    (``cluster.serving.pool_ratio``). No traffic in the mix window: the band is kept for when traffic returns, and
    each pool follows its own load. Keeps the band and the last measured prefill throughput between ticks."""

    def __init__(self) -> None:
        self.band: RatioBand | None = None
        #: The last measured prefill throughput, for windows in which no prefill finished.
        self.prefill_tokens_per_s: float | None = None
        self._log = DecisionLog()

    def __call__(self, contexts: Mapping[Any, Any]) -> tuple[dict[Any, int], dict[Any, dict[str, Any]]]:
        pools: dict[str, _Pool] = {}
        ratio: PoolRatioConfig | None = None
        for deployment, ctx in contexts.items():
            pool = _POOLS.get(ctx.deployment_name)
            if pool is None:  # not ours: Serve leaves a deployment without a decision as it is
                continue
            t, ratio = read_policy_kwargs(ctx.config.policy.policy_kwargs)  # the same ServeConfig's on both
            decide = prefill_decision if pool == "prefill" else decode_decision
            pools[pool] = _Pool(deployment, ctx, t, decide(ctx, t))
        if ratio is not None and "prefill" in pools and "decode" in pools:
            prefill = pools["prefill"]
            pools["prefill"] = dataclasses.replace(prefill, decision=self._keep_ratio(prefill, pools["decode"], ratio))
        for pool, p in pools.items():
            self._log.decided(pool, p.ctx.current_num_replicas, p.decision)
        return {p.deployment: p.decision.desired for p in pools.values()}, {}

    def _keep_ratio(self, prefill: _Pool, decode: _Pool, r: PoolRatioConfig) -> Decision:
        own = prefill.decision
        mix = measure_mix(prefill.ctx, decode.ctx, r.mix_window_s)
        if mix is None:
            return own
        if mix.prefill_tokens_per_s is not None:
            self.prefill_tokens_per_s = mix.prefill_tokens_per_s
        mix = dataclasses.replace(mix, prefill_tokens_per_s=self.prefill_tokens_per_s)
        needed = needed_ratio(mix, decode.thresholds, r)
        self.band = band = next_band(self.band, needed, r)
        if band is None or needed is None:
            return own
        # The decode replicas there or on their way: prefill follows a decode scale-up at once, and a decode
        # scale-down only once Serve has applied it.
        decode_replicas = max(decode.ctx.target_num_replicas, decode.decision.desired)
        kept = keep_ratio(own.desired, decode_replicas, band, prefill.thresholds)
        low, high = band.prefill_range(decode_replicas)
        change = f"{own.desired} -> {kept}: " if kept != own.desired else ""
        capacity = mix.prefill_tokens_per_s
        at = f" at {capacity:.0f}/s per prefill replica" if capacity is not None else ""
        why = (
            f"{own.why}; {change}prefill:decode band {band.low:.2f}-{band.high:.2f}, {low}-{high} prefill replicas for "
            f"{decode_replicas} decode (the mix needs {needed:.2f}: REMOTE prompts "
            f"{mix.remote_prompt_tokens_per_s:.0f} tokens/s{at}, the load of "
            f"{decode_replicas_needed(mix, decode.thresholds):.1f} decode replicas)"
        )
        return Decision(kept, why)


#: Serve wants its look-back longer than its (deprecated) ``metrics_interval_s``, 10 s by default.
_MIN_LOOK_BACK_S = 15.0


def look_back_s(t: AutoscalingThresholds, ratio: PoolRatioConfig | None = None) -> float:
    """How much of each replica's samples Serve keeps: what the policies' windows read."""
    mix_window_s = ratio.mix_window_s if ratio is not None else 0.0
    return max(t.spike_window_s, t.trend_window_s, mix_window_s, _MIN_LOOK_BACK_S)


def replica_env(t: AutoscalingThresholds, ratio: PoolRatioConfig | None = None) -> dict[str, str]:
    """Environment of an autoscaled pool's replicas: Serve reads how often a replica samples its load and pushes
    the samples from the replica's environment only (by default it samples every look-back / 5 and pushes every
    10 s, which leaves a decision up to 10 s behind the load)."""
    return {
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": str(t.metrics_push_interval_s),
        "RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR": str(t.metrics_push_interval_s / look_back_s(t, ratio)),
    }


def serve_autoscaling_config(
    pool: str, t: AutoscalingThresholds, ratio: PoolRatioConfig | None = None
) -> dict[str, Any]:
    """The ``autoscaling_config`` dict of a pool's deployment for these thresholds (and the ServeConfig's
    ``pool_ratio``, which rides in the policy's kwargs for the application-level policy)."""
    policy = PrefillAutoscalingPolicy if pool == "prefill" else DecodeAutoscalingPolicy
    return {
        "min_replicas": t.min_replicas,
        "max_replicas": t.max_replicas,
        "upscale_delay_s": t.upscale_delay_s,
        "downscale_delay_s": t.downscale_delay_s,
        "look_back_period_s": look_back_s(t, ratio),
        "policy": {"policy_function": policy, "policy_kwargs": policy_kwargs(t, ratio)},
    }
