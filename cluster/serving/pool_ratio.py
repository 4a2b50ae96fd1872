"""The prefill:decode replica ratio the observed class mix needs, and the band the two pools are kept in.

Pure (no Ray, no clocks): the application-level policy in ``cluster/serving/autoscaling.py`` measures a
``ClassMix`` from both pools' reported counters and applies what this module decides.

- The prefill pool's work is the prompt tokens of REMOTE requests per second (the decode replicas count them
  as they hand them over); a prefill replica's capacity is the prompt tokens it computes per second of engine
  time (measured on the prefill replicas). Prefill replicas the mix needs = the first over the second.
- The decode pool's work is what its own policy scales on: running sequences over
  ``target_running_seqs_per_replica`` and KV use over ``kv_usage_scale_up``, whichever needs more replicas
  (a long-prompt mix fills KV before it fills sequences).
- The ratio needed is their quotient, bounded to ``[min_prefill_per_decode, max_prefill_per_decode]``. A band
  ``[r / (1 + band), r x (1 + band)]`` is kept around it and moves only when a measured ratio leaves it, so a
  noisy mix moves no replica.
- Decode is the anchor (its replicas hold the streams and their KV): the prefill pool's own decision is
  clamped into the band times the decode replicas, rounded outwards (a ratio is kept to within one replica).
  A long-prompt mix pulls prefill up with decode before its queue shows the load; a chat mix caps a prefill
  pool that a short queue burst would grow past what the mix's throughput needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.serving.config import AutoscalingThresholds, PoolRatioConfig

#: Float slack when a band edge times a replica count is rounded (2.0000000001 replicas is 2).
_EPS = 1e-9


@dataclass(frozen=True)
class ClassMix:
    """What both pools did over the mix window (sums over each pool's replicas)."""

    #: Prompt tokens of REMOTE requests handed to the prefill pool per second.
    remote_prompt_tokens_per_s: float
    #: Mean running sequences over the decode pool.
    running_seqs: float
    #: Mean KV use summed over the decode replicas (1.0 = one replica's blocks all in use).
    kv_in_use: float
    #: Prompt tokens one prefill replica computes per second of engine time; None before any was measured.
    prefill_tokens_per_s: float | None

    @property
    def idle(self) -> bool:
        """No traffic in the window: nothing to derive a ratio from."""
        return self.remote_prompt_tokens_per_s <= 0 and self.running_seqs <= 0


def decode_replicas_needed(mix: ClassMix, decode: AutoscalingThresholds) -> float:
    """Decode replicas the window's load fills to the decode pool's targets (fractional)."""
    return max(mix.running_seqs / decode.target_running_seqs_per_replica, mix.kv_in_use / decode.kv_usage_scale_up)


def needed_ratio(mix: ClassMix, decode: AutoscalingThresholds, r: PoolRatioConfig) -> float | None:
    """Prefill replicas per decode replica the mix needs, within the configured bounds; None when idle, or when
    REMOTE prompts arrive before a prefill replica's throughput is known."""
    if mix.idle:
        return None
    if mix.remote_prompt_tokens_per_s <= 0:  # all LOCAL: the prefill pool has nothing to do
        prefill = 0.0
    elif mix.prefill_tokens_per_s is None or mix.prefill_tokens_per_s <= 0:
        return None
    else:
        prefill = mix.remote_prompt_tokens_per_s / mix.prefill_tokens_per_s
    decode_needed = decode_replicas_needed(mix, decode)
    ratio = prefill / decode_needed if decode_needed > 0 else math.inf
    return min(r.max_prefill_per_decode, max(r.min_prefill_per_decode, ratio))


@dataclass(frozen=True)
class RatioBand:
    """Prefill replicas per decode replica kept: ``low`` .. ``high`` around ``needed``."""

    needed: float
    low: float
    high: float

    def prefill_range(self, decode_replicas: int) -> tuple[int, int]:
        """Prefill replicas the band allows beside ``decode_replicas``, rounded outwards."""
        return (
            math.floor(self.low * decode_replicas + _EPS),
            math.ceil(self.high * decode_replicas - _EPS),
        )


def next_band(previous: RatioBand | None, needed: float | None, r: PoolRatioConfig) -> RatioBand | None:
    """The band after a measurement: unchanged while ``needed`` is inside it or unknown (no traffic: the last
    mix holds until traffic says otherwise), centred on ``needed`` once it leaves."""
    if needed is None or (previous is not None and previous.low <= needed <= previous.high):
        return previous
    return RatioBand(needed, needed / (1 + r.band), needed * (1 + r.band))


def keep_ratio(prefill_desired: int, decode_replicas: int, band: RatioBand, prefill: AutoscalingThresholds) -> int:
    """The prefill pool's decision clamped into the band beside ``decode_replicas``; its own min/max win."""
    low, high = band.prefill_range(decode_replicas)
    within = min(high, max(low, prefill_desired))
    return max(prefill.min_replicas, min(prefill.max_replicas, within))
