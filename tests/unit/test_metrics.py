"""Router metrics: client-side timings, goodput against the SLO, pool stats rendering (no Ray)."""

from cluster.serving.config import SLOConfig
from cluster.serving.messages import BatchGeometry, EngineStats, ReplicaStats
from cluster.serving.metrics import RequestTiming, RouterMetrics


def test_timings_goodput_and_pool_families():
    stats = [
        ReplicaStats(
            pool="decode",
            replica_id="d1",
            engine=EngineStats(
                kv_blocks_total=100,
                kv_dtype="bfloat16",
                kv_blocks_used=25,
                prefix_queries=10,
                prefix_hits=4,
                steps=7,
                step_seconds=1.5,
                step_cpu_seconds=1.25,
                geometry=BatchGeometry(num_seqs=3, prefill_fraction=0.5),
            ),
        )
    ]
    m = RouterMetrics(SLOConfig(ttft_ms=100, tpot_ms=50), stats_source=lambda: stats)
    fast = RequestTiming(arrival=0.0, route="remote", started=0.01)
    for t in (0.05, 0.08, 0.11):  # TTFT 50 ms, TPOT 30 ms
        m.observe_token(fast, t)
    m.observe_finished(fast, "ok", num_prompt_tokens=40)
    slow = RequestTiming(arrival=0.0, route="remote")
    for t in (0.5, 0.6):  # TTFT 500 ms: misses the SLO
        m.observe_token(slow, t)
    m.observe_finished(slow, "ok", num_prompt_tokens=40)
    text = m.render().decode()
    assert 'shapeserve_goodput_requests_total{route="remote"} 1.0' in text
    assert 'shapeserve_requests_total{outcome="ok",route="remote"} 2.0' in text
    assert 'shapeserve_time_to_first_token_seconds_count{route="remote"} 2.0' in text
    assert 'shapeserve_inter_token_latency_seconds_count{route="remote"} 3.0' in text
    assert 'shapeserve_generation_tokens_total{route="remote"} 5.0' in text
    assert 'shapeserve_pool_kv_usage{pool="decode",replica="d1"} 0.25' in text
    assert 'shapeserve_pool_prefix_cache_hit_rate{pool="decode",replica="d1"} 0.4' in text
    assert 'shapeserve_batch_prefill_fraction{pool="decode",replica="d1"} 0.5' in text
    assert 'shapeserve_pool_kv_format_info{dtype="bfloat16",pool="decode",replica="d1"} 1.0' in text
    assert 'shapeserve_engine_steps_total{pool="decode",replica="d1"} 7.0' in text
    assert 'shapeserve_engine_step_seconds_total{pool="decode",replica="d1"} 1.5' in text
    assert 'shapeserve_engine_step_cpu_seconds_total{pool="decode",replica="d1"} 1.25' in text
    assert fast.num_output_tokens == 3
