"""Replica ranking for the decode and prefill request routers, and the autoscaling decisions (no Ray cluster)."""

from collections import OrderedDict

from cluster.serving.autoscaling import (
    DecodeAutoscalingPolicy,
    PrefillAutoscalingPolicy,
    decode_desired_replicas,
    prefill_desired_replicas,
    serve_autoscaling_config,
)
from cluster.prefix_hash import hash_full_blocks
from cluster.serving.config import AutoscalingThresholds
from cluster.serving.messages import DecodeRoutingStats, PrefillRoutingStats
from router.replica_choice import prefix_overlap, rank_decode, rank_prefill


def decode_stats(*dicts):
    """What Serve hands the router (dicts; {} for a replica that has not reported), parsed as the router does."""
    return [DecodeRoutingStats.from_dict(d) for d in dicts]


def prefill_stats(*dicts):
    return [PrefillRoutingStats.from_dict(d) for d in dicts]


def test_decode_prefers_replica_that_fits_then_least_loaded():
    stats = decode_stats(
        {"kv_blocks_free": 5, "kv_blocks_total": 100, "running": 0},  # does not fit 10 blocks
        {"kv_blocks_free": 50, "kv_blocks_total": 100, "running": 3},
        {"kv_blocks_free": 20, "kv_blocks_total": 100, "running": 1},
    )
    assert rank_decode(stats, need_blocks=10) == [2, 1, 0]


def test_decode_ties_break_on_batch_tokens_then_headroom():
    stats = decode_stats(
        {"kv_blocks_free": 30, "kv_blocks_total": 100, "running": 2, "batch_tokens": 500},
        {"kv_blocks_free": 30, "kv_blocks_total": 100, "running": 2, "batch_tokens": 2},
        {"kv_blocks_free": 90, "kv_blocks_total": 100, "running": 2, "batch_tokens": 2},
    )
    assert rank_decode(stats, need_blocks=4) == [2, 1, 0]


def test_decode_unknown_stats_count_as_empty():
    stats = decode_stats({"running": 4, "kv_blocks_free": 100, "kv_blocks_total": 100}, {})
    assert rank_decode(stats, 1) == [1, 0]


def test_prefix_overlap_counts_leading_blocks():
    a = hash_full_blocks(list(range(64)), 16)
    known = OrderedDict((h, None) for h in a[:3])
    assert prefix_overlap(known, a) == 3
    assert prefix_overlap(None, a) == 0
    other = hash_full_blocks([1] * 16 + list(range(16, 64)), 16)
    assert prefix_overlap(known, other) == 0  # chained hashes: a different first block changes all


def test_prefill_affinity_beats_small_queue_difference():
    # 128-token prompt; replica 1 has 6 of its 8 blocks (96 tokens) but 50 more tokens queued
    stats = prefill_stats({"queued_prefill_tokens": 0}, {"queued_prefill_tokens": 50})
    assert rank_prefill(stats, overlaps=[0, 6], num_prompt_tokens=128, block_size=16) == [1, 0]


def test_prefill_long_queue_beats_affinity():
    stats = prefill_stats({"queued_prefill_tokens": 0}, {"queued_prefill_tokens": 5000})
    assert rank_prefill(stats, overlaps=[0, 6], num_prompt_tokens=128, block_size=16) == [0, 1]


T = AutoscalingThresholds(
    min_replicas=1,
    max_replicas=4,
    target_queued_prefill_tokens_per_replica=1000,
    kv_usage_scale_up=0.8,
    kv_usage_scale_down=0.3,
    target_running_seqs_per_replica=10,
)


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


class Ctx:
    def __init__(self, current, metrics):
        self.current_num_replicas = current
        self.aggregated_metrics = metrics


def test_policy_classes_read_replica_metrics():
    p = PrefillAutoscalingPolicy(**T.model_dump())
    assert p(Ctx(1, {"queued_prefill_tokens": {"a": 1500.0, "b": 900.0}}))[0] == 3
    assert p(Ctx(2, {}))[0] == 2
    d = DecodeAutoscalingPolicy(**T.model_dump())
    assert d(Ctx(2, {"kv_usage": {"a": 0.95, "b": 0.85}, "running_seqs": {"a": 3.0, "b": 3.0}}))[0] == 3
    cfg = serve_autoscaling_config("decode", T)
    assert cfg["policy"]["policy_function"] is DecodeAutoscalingPolicy and cfg["max_replicas"] == 4
