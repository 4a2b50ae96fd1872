"""Replica ranking for the decode and prefill request routers (no Ray cluster)."""

from collections import OrderedDict

from cluster.prefix_hash import hash_full_blocks
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


def test_decode_counts_requests_in_flight_that_stats_have_not_seen_yet():
    """Between two stats polls both replicas read empty: the requests this router sent since then spread a burst."""
    idle = {"kv_blocks_free": 100, "kv_blocks_total": 100}
    assert rank_decode(decode_stats(idle, idle), 1, in_flight=[1, 0]) == [1, 0]
    assert rank_decode(decode_stats(idle, idle), 1, in_flight=[2, 2]) == [0, 1]
    # The larger of the two counts: a replica reporting 3 sequences is busier than one with 2 requests in flight.
    busy = {"kv_blocks_free": 100, "kv_blocks_total": 100, "running": 3}
    assert rank_decode(decode_stats(busy, idle), 1, in_flight=[0, 2]) == [1, 0]
    # Fitting the request still comes first.
    full = {"kv_blocks_free": 0, "kv_blocks_total": 100}
    assert rank_decode(decode_stats(full, idle), 1, in_flight=[0, 5]) == [1, 0]


def test_prefill_ties_go_to_fewer_requests_in_flight():
    stats = prefill_stats({}, {})
    assert rank_prefill(stats, [0, 0], 64, 16, in_flight=[1, 0]) == [1, 0]
    # Tokens to compute still rule: a cached prefix beats an idle replica.
    assert rank_prefill(stats, [3, 0], 64, 16, in_flight=[4, 0]) == [0, 1]


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
