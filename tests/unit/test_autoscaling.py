"""The pools' autoscaling decisions and Serve policy classes (no Ray cluster)."""

from cluster.serving.autoscaling import (
    DecodeAutoscalingPolicy,
    PrefillAutoscalingPolicy,
    decode_desired_replicas,
    prefill_desired_replicas,
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
