"""Where the pools go on a cluster: exact decisions for the node sizes users run (no Ray)."""

import pytest

from cluster.serving.config import parse_serve_config
from cluster.serving.placement import Placement, PoolPlacement, describe, place_pools


def config(**fields):
    return parse_serve_config({"device": "cpu", **fields})


def test_small_cpu_node_colocates_with_every_core_on_the_decode_engine():
    p = place_pools(config(), cluster_cpus=2, cluster_gpus=0)
    assert p == Placement(PoolPlacement(2.0, 0.0, 2), None, p.reason)
    assert not p.disaggregated and "it pays from 4 CPUs" in p.reason
    assert describe(p).startswith("pools: colocated")


def test_larger_cpu_node_gives_the_prefill_pool_a_quarter():
    p = place_pools(config(), cluster_cpus=16, cluster_gpus=0)
    assert p.prefill == PoolPlacement(4.0, 0.0, 4) and p.decode == PoolPlacement(12.0, 0.0, 12)


def test_explicit_settings_win():
    p = place_pools(config(disaggregation="on"), cluster_cpus=2, cluster_gpus=0)
    assert p.prefill == PoolPlacement(1.0, 0.0, 1) and p.decode == PoolPlacement(1.0, 0.0, 1)
    p = place_pools(config(disaggregation="off"), cluster_cpus=32, cluster_gpus=0)
    assert p.prefill is None and p.decode == PoolPlacement(32.0, 0.0, 32)
    p = place_pools(config(decode={"num_cpus": 3, "num_threads": 2}), cluster_cpus=8, cluster_gpus=0)
    assert p.decode == PoolPlacement(3, 0.0, 2)


def test_replicas_split_their_pool_share():
    p = place_pools(config(decode={"num_replicas": 2}), cluster_cpus=4, cluster_gpus=0)
    assert p.prefill == PoolPlacement(1.0, 0.0, 1) and p.decode == PoolPlacement(1.5, 0.0, 1)
    p = place_pools(config(decode={"num_replicas": 2}), cluster_cpus=2, cluster_gpus=0)
    assert p.prefill is None and p.decode == PoolPlacement(1.0, 0.0, 1)


@pytest.mark.parametrize("disaggregation, prefill", [("auto", True), ("off", False)])
def test_gpus_give_each_replica_one(disaggregation, prefill):
    p = place_pools(config(disaggregation=disaggregation), cluster_cpus=8, cluster_gpus=2)
    assert p.decode == PoolPlacement(1.0, 1.0, 1)
    assert (p.prefill == PoolPlacement(1.0, 1.0, 1)) if prefill else p.prefill is None


def test_pools_pinned_to_node_types_take_one_cpu_unless_told():
    p = place_pools(config(decode={"resources": {"decode": 1}}, prefill={"resources": {"prefill": 1}}), 12, 0)
    assert p.decode.num_cpus == 1.0 and p.prefill is not None and p.prefill.num_cpus == 1.0
