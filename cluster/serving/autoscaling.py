"""Custom Serve autoscaling policies for the two pools; thresholds come from the ServeConfig.

Each pool replica reports its load through Serve's ``record_autoscaling_stats`` (prefill:
``queued_prefill_tokens``; decode: ``kv_usage`` and ``running_seqs``); Serve hands the policies
every replica's recent samples (``raw_metrics``) and their look-back means. The decisions are
pure functions of those numbers and an ``AutoscalingThresholds`` (tested without Ray); the
policy classes adapt them to Serve's ``AutoscalingContext`` (``policy_kwargs`` = the
thresholds, so a config edit changes the policy) and log every change with its inputs.

- Prefill scales ahead of the load: the queue is predicted ``replica_startup_s`` ahead from its
  trend (a least-squares slope over ``trend_window_s``), since a replica asked for now only
  serves that much later.
- Decode scales on the peak of KV use and running sequences over ``spike_window_s``: a
  look-back mean averages a short spike away, and a decode replica that runs out of KV blocks
  preempts.

Hysteresis comes from the band between the up and down thresholds and Serve's upscale/
downscale delays; a replica chosen for scale-down drains (Serve stops routing to it and waits
``graceful_shutdown_timeout_s`` for its running requests) before it goes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.serving.config import AutoscalingThresholds

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Sample:
    """One reported value of one replica (Serve's ``TimeStampedValue``: ``timestamp``, ``value``)."""

    timestamp: float
    value: float


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


def prefill_desired_replicas(current: int, queued_prefill_tokens: float, t: AutoscalingThresholds) -> int:
    """Replicas so that each carries about ``target_queued_prefill_tokens_per_replica`` queued tokens."""
    return _clamp(math.ceil(queued_prefill_tokens / t.target_queued_prefill_tokens_per_replica), t)


def predicted_queue(queued_now: float, trend_tokens_per_s: float, t: AutoscalingThresholds) -> float:
    """The queue when a replica asked for now would start serving, if it keeps growing as it has (a shrinking
    queue is not extrapolated down: scale-down waits for the queue itself)."""
    return queued_now + max(0.0, trend_tokens_per_s) * t.replica_startup_s


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


# ---- Serve's side --------------------------------------------------------------------------------------------


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


class _LoggedDecisions:
    """Logs a pool's decision when it changes (Serve calls a policy about every 0.1 s, and a decision stands
    through Serve's delay and the new replica's start): one line per change, with its inputs."""

    pool = ""

    def _decided(self, ctx: Any, desired: int, why: str) -> tuple[int, dict[str, Any]]:
        current = ctx.current_num_replicas
        if desired != current and (current, desired) != getattr(self, "_last_logged", None):
            log.info("autoscaling %s pool: %d -> %d replicas (%s)", self.pool, current, desired, why)
        self._last_logged = (current, desired) if desired != current else None
        return desired, getattr(ctx, "policy_state", None) or {}


class PrefillAutoscalingPolicy(_LoggedDecisions):
    """Serve policy (``policy_function`` = this class, ``policy_kwargs`` = AutoscalingThresholds fields); Serve
    makes one instance per deployment and calls it every tick."""

    pool = "prefill"

    def __init__(self, **thresholds: Any):
        self.t = AutoscalingThresholds(**thresholds)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        per_replica = _series(ctx, "queued_prefill_tokens")
        if not per_replica:
            return _clamp(ctx.current_num_replicas, self.t), getattr(ctx, "policy_state", None) or {}
        queued = sum(series[-1].value for series in per_replica)
        trend = sum(queue_trend(series, self.t.trend_window_s) for series in per_replica)
        predicted = predicted_queue(queued, trend, self.t)
        desired = prefill_desired_replicas(ctx.current_num_replicas, predicted, self.t)
        why = (
            f"queued prefill tokens {queued:.0f}, trend {trend:+.0f}/s, predicted {predicted:.0f} in "
            f"{self.t.replica_startup_s:g} s; target {self.t.target_queued_prefill_tokens_per_replica} per replica"
        )
        return self._decided(ctx, desired, why)


class DecodeAutoscalingPolicy(_LoggedDecisions):
    pool = "decode"

    def __init__(self, **thresholds: Any):
        self.t = AutoscalingThresholds(**thresholds)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        usage = _series(ctx, "kv_usage")
        running = _series(ctx, "running_seqs")
        if not usage:
            return _clamp(ctx.current_num_replicas, self.t), getattr(ctx, "policy_state", None) or {}
        window = self.t.spike_window_s
        kv_peak = sum(peak(series, window) for series in usage) / len(usage)
        seqs_peak = sum(peak(series, window) for series in running)
        desired = decode_desired_replicas(ctx.current_num_replicas, kv_peak, seqs_peak, self.t)
        why = (
            f"KV use peak {kv_peak:.2f} and running sequences peak {seqs_peak:.0f} over {window:g} s; "
            f"thresholds {self.t.kv_usage_scale_down}-{self.t.kv_usage_scale_up}, "
            f"{self.t.target_running_seqs_per_replica} sequences per replica"
        )
        return self._decided(ctx, desired, why)


#: Serve wants its look-back longer than its (deprecated) ``metrics_interval_s``, 10 s by default.
_MIN_LOOK_BACK_S = 15.0


def look_back_s(t: AutoscalingThresholds) -> float:
    """How much of each replica's samples Serve keeps: what the policies' windows read."""
    return max(t.spike_window_s, t.trend_window_s, _MIN_LOOK_BACK_S)


def replica_env(t: AutoscalingThresholds) -> dict[str, str]:
    """Environment of an autoscaled pool's replicas: Serve reads how often a replica samples its load and pushes
    the samples from the replica's environment only (by default it samples every look-back / 5 and pushes every
    10 s, which leaves a decision up to 10 s behind the load)."""
    return {
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": str(t.metrics_push_interval_s),
        "RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR": str(t.metrics_push_interval_s / look_back_s(t)),
    }


def serve_autoscaling_config(pool: str, t: AutoscalingThresholds) -> dict[str, Any]:
    """The ``autoscaling_config`` dict of a pool's deployment for these thresholds."""
    policy = PrefillAutoscalingPolicy if pool == "prefill" else DecodeAutoscalingPolicy
    return {
        "min_replicas": t.min_replicas,
        "max_replicas": t.max_replicas,
        "upscale_delay_s": t.upscale_delay_s,
        "downscale_delay_s": t.downscale_delay_s,
        "look_back_period_s": look_back_s(t),
        "policy": {"policy_function": policy, "policy_kwargs": t.model_dump()},
    }
