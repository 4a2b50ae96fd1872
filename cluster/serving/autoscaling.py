"""Custom Serve autoscaling policies for the two pools; thresholds come from the config files.

Each pool replica reports its load through Serve's ``record_autoscaling_stats`` (prefill:
``queued_prefill_tokens``; decode: ``kv_usage`` and ``running_seqs``). The decisions are
pure functions of those numbers and an ``AutoscalingThresholds`` (tested without Ray); the
policy classes adapt them to Serve's ``AutoscalingContext`` (``policy_kwargs`` = the
thresholds, so a YAML edit changes the policy). Hysteresis comes from Serve's upscale/
downscale delays; a replica chosen for scale-down drains (Serve stops routing to it and waits
``graceful_shutdown_timeout_s`` for its running requests) before it goes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from cluster.serving.config import AutoscalingThresholds


def _clamp(n: int, t: AutoscalingThresholds) -> int:
    return max(t.min_replicas, min(t.max_replicas, n))


def prefill_desired_replicas(current: int, queued_prefill_tokens: float, t: AutoscalingThresholds) -> int:
    """Replicas so that each carries about ``target_queued_prefill_tokens_per_replica`` queued tokens."""
    return _clamp(math.ceil(queued_prefill_tokens / t.target_queued_prefill_tokens_per_replica), t)


def decode_desired_replicas(current: int, kv_usage: float, running_seqs: float, t: AutoscalingThresholds) -> int:
    """Up by one above the KV-use threshold (or when sequences outgrow the target), down by one below.

    ``kv_usage``: mean KV block use over replicas (0..1); ``running_seqs``: total running sequences.
    """
    by_seqs = math.ceil(running_seqs / t.target_running_seqs_per_replica)
    if kv_usage > t.kv_usage_scale_up or by_seqs > current:
        return _clamp(max(current + 1, by_seqs), t)
    if kv_usage < t.kv_usage_scale_down and by_seqs < current:
        return _clamp(current - 1, t)
    return _clamp(current, t)


def _per_replica(ctx: Any, name: str) -> list[float]:
    metrics: Mapping[str, Mapping[Any, float]] | None = ctx.aggregated_metrics
    if not metrics or name not in metrics:
        return []
    return [float(v) for v in metrics[name].values()]


class PrefillAutoscalingPolicy:
    """Serve policy (``policy_function`` = this class, ``policy_kwargs`` = AutoscalingThresholds fields)."""

    def __init__(self, **thresholds: Any):
        self.t = AutoscalingThresholds(**thresholds)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        queued = _per_replica(ctx, "queued_prefill_tokens")
        if not queued:
            return _clamp(ctx.current_num_replicas, self.t), {}
        return prefill_desired_replicas(ctx.current_num_replicas, sum(queued), self.t), {}


class DecodeAutoscalingPolicy:
    def __init__(self, **thresholds: Any):
        self.t = AutoscalingThresholds(**thresholds)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        usage = _per_replica(ctx, "kv_usage")
        running = _per_replica(ctx, "running_seqs")
        if not usage:
            return _clamp(ctx.current_num_replicas, self.t), {}
        mean_usage = sum(usage) / len(usage)
        return decode_desired_replicas(ctx.current_num_replicas, mean_usage, sum(running), self.t), {}


def serve_autoscaling_config(pool: str, t: AutoscalingThresholds) -> dict[str, Any]:
    """The ``autoscaling_config`` dict of a pool's deployment for these thresholds."""
    policy = PrefillAutoscalingPolicy if pool == "prefill" else DecodeAutoscalingPolicy
    return {
        "min_replicas": t.min_replicas,
        "max_replicas": t.max_replicas,
        "upscale_delay_s": t.upscale_delay_s,
        "downscale_delay_s": t.downscale_delay_s,
        "policy": {"policy_function": policy, "policy_kwargs": t.model_dump()},
    }
