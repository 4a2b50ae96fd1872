"""Router metrics: client-side timings, goodput against the SLO, pool stats rendering (no Ray)."""

from prometheus_client.parser import text_string_to_metric_families

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


VLLM_SERIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
}


def test_vllm_names_carry_the_same_values_with_model_name():
    stats = [
        ReplicaStats(
            pool="decode",
            replica_id="d1",
            engine=EngineStats(running=3, waiting=2, kv_blocks_total=100, kv_blocks_used=25, preemptions=4),
        ),
        ReplicaStats(pool="prefill", replica_id="p1", engine=EngineStats(running=9)),  # not a vLLM engine
    ]
    m = RouterMetrics(SLOConfig(ttft_ms=100, tpot_ms=50), stats_source=lambda: stats, model_name="llama")
    for route, prompt in (("local", 10), ("remote", 30)):
        t = RequestTiming(arrival=0.0, route=route, started=0.02)
        for now in (0.05, 0.08, 0.11):
            m.observe_token(t, now)
        m.observe_finished(t, "ok", num_prompt_tokens=prompt)
    failed = RequestTiming(arrival=0.0, route="local")
    m.observe_finished(failed, "error", num_prompt_tokens=5)

    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    for name, kind in VLLM_SERIES.items():
        assert name in families and families[name].type == kind, name
        assert all(s.labels.get("model_name") == "llama" for s in families[name].samples), name

    def total(name, suffix=""):
        return sum(s.value for s in families[name].samples if s.name == name + suffix)

    assert total("vllm:time_to_first_token_seconds", "_count") == 2
    assert total("vllm:time_to_first_token_seconds", "_count") == total(
        "shapeserve_time_to_first_token_seconds", "_count"
    )
    assert total("vllm:inter_token_latency_seconds", "_count") == 4
    assert total("vllm:prompt_tokens", "_total") == 40 and total("vllm:generation_tokens", "_total") == 6
    assert total("vllm:request_success", "_total") == 2  # the failed request is not a success
    assert total("vllm:num_requests_running") == 3  # decode engines only
    assert total("vllm:kv_cache_usage_perc") == 0.25
    assert total("vllm:num_preemptions", "_total") == 4


def test_error_and_rejection_series_exist_before_the_first_one():
    # A dashboard panel of 429s or 5xx shows 0, not "no data", on a server that has had none.
    text = RouterMetrics(SLOConfig()).render().decode()
    for line in (
        'shapeserve_rejected_requests_total{route_class="local"} 0.0',
        'shapeserve_rejected_requests_total{route_class="remote"} 0.0',
        'shapeserve_request_errors_total{status="503"} 0.0',
    ):
        assert line in text


# ---- the cluster scope: Ray's endpoints read back and summed --------------------------------------------------

_RAY_LABELS = 'Component="core_worker",NodeAddress="{node}",SessionName="s",Version="2.60.0",WorkerId="{worker}"'


def ray_page(node: str, worker_counts: dict[str, tuple[int, float]]) -> str:
    """A node's Ray endpoint as Ray 2.60 writes it: Ray's own series, then ours prefixed ``ray_`` with the process
    labels Ray adds; ``worker_counts``: worker -> (requests served, TTFT of each)."""
    lines = ["# HELP ray_tasks Current number of tasks", "# TYPE ray_tasks gauge", 'ray_tasks{State="RUNNING"} 3.0']
    lines += ["# HELP ray_shapeserve_requests_total Finished requests", "# TYPE ray_shapeserve_requests_total counter"]
    for worker, (n, _) in worker_counts.items():
        labels = _RAY_LABELS.format(node=node, worker=worker)
        lines.append(f'ray_shapeserve_requests_total{{{labels},outcome="ok",route="local"}} {float(n)}')
    lines += [
        "# HELP ray_shapeserve_time_to_first_token_seconds TTFT at the router",
        "# TYPE ray_shapeserve_time_to_first_token_seconds histogram",
    ]
    for worker, (n, ttft) in worker_counts.items():
        labels = _RAY_LABELS.format(node=node, worker=worker) + ',route="local"'
        for le in ("0.1", "1.0", "+Inf"):
            count = n if ttft <= float(le) else 0
            lines.append(f'ray_shapeserve_time_to_first_token_seconds_bucket{{{labels},le="{le}"}} {float(count)}')
        lines.append(f"ray_shapeserve_time_to_first_token_seconds_count{{{labels}}} {float(n)}")
        lines.append(f"ray_shapeserve_time_to_first_token_seconds_sum{{{labels}}} {n * ttft}")
    return "\n".join(lines) + "\n"


def test_cluster_scope_sums_every_process_of_every_node_and_keeps_a_silent_nodes_counts():
    from cluster.serving.metrics import REQUEST_FAMILIES
    from cluster.serving.ray_metrics import ClusterMetricsReader

    pages = {
        "a:8080": ray_page("a", {"w1": (3, 0.05), "w2": (2, 0.5)}),  # w2: a replica that died; Ray keeps its series
        "b:8080": ray_page("b", {"w3": (4, 0.05)}),
    }

    def fetch(endpoint: str) -> str:
        page = pages[endpoint]
        if page is None:
            raise OSError("connection refused")
        return page

    reader = ClusterMetricsReader(REQUEST_FAMILIES, endpoints=lambda: list(pages), fetch=fetch)
    m = RouterMetrics(SLOConfig(), model_name="llama", scope="replica")
    m.reader = reader  # the page of the cluster scope, without recording through Ray

    def scrape() -> dict[str, float]:
        text = m.render().decode()
        return {
            f"{s.name}{sorted(s.labels.items())}": s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    first = scrape()
    assert first["shapeserve_requests_total[('outcome', 'ok'), ('route', 'local')]"] == 9
    assert first["shapeserve_time_to_first_token_seconds_count[('route', 'local')]"] == 9
    assert first["shapeserve_time_to_first_token_seconds_bucket[('le', '0.1'), ('route', 'local')]"] == 7
    assert first["shapeserve_time_to_first_token_seconds_bucket[('le', '+Inf'), ('route', 'local')]"] == 9
    assert first["vllm:time_to_first_token_seconds_count[('model_name', 'llama'), ('route', 'local')]"] == 9
    assert first["vllm:request_success_total[('model_name', 'llama'), ('route', 'local')]"] == 9
    assert first["shapeserve_request_errors_total[('status', '503')]"] == 0  # zero series before the first one
    assert not any("WorkerId" in key or "ray_tasks" in key for key in first)  # Ray's labels and series stay out

    pages["b:8080"] = None  # node b does not answer this scrape: its last counts stand in
    assert scrape() == first and reader.failed_reads == 1
    pages["b:8080"] = ray_page("b", {"w3": (6, 0.05)})
    later = scrape()
    assert later["shapeserve_requests_total[('outcome', 'ok'), ('route', 'local')]"] == 11
    assert all(later[key] >= value for key, value in first.items())  # counters only grow
