"""Prometheus metric definitions for the serving cluster, and the pool stats replicas report.

Two sources feed one ``/metrics`` page (served by every decode replica's HTTP edge):
  - client-side latency per route class (TTFT, TPOT, inter-token latency, end-to-end, queue
    time), goodput under the configured SLOs, rejections: ``RouterMetrics``, observed at the edge;
    in a serving cluster recorded through Ray's metrics pipeline and read back summed over every
    replica (``cluster.serving.ray_metrics``), so any replica's page is the cluster's;
  - pool state, transfers and batch geometry: each replica reports a ``ReplicaStats`` snapshot
    (plain numbers, cumulative counters) and the router renders the latest ones at scrape
    time through ``PoolStatsCollector``.
No process-global default registry: a ``RouterMetrics`` renders each page from its own collectors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cluster.serving.config import SLOConfig
from cluster.serving.messages import ReplicaStats
from cluster.serving.ray_metrics import ClusterMetricsReader, MetricSpec, RayFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class PoolStatsCollector:
    """Renders the latest ``ReplicaStats`` of every replica as Prometheus families at scrape time."""

    def __init__(self, source: Callable[[], Iterable[ReplicaStats]]):
        self.source = source

    def collect(self):
        stats = list(self.source())
        labels = ["pool", "replica"]

        def gauge(name, doc, get):
            g = GaugeMetricFamily(f"shapeserve_{name}", doc, labels=labels)
            for s in stats:
                g.add_metric([s.pool, s.replica_id], float(get(s)))
            return g

        def counter(name, doc, get):
            c = CounterMetricFamily(f"shapeserve_{name}", doc, labels=labels)
            for s in stats:
                c.add_metric([s.pool, s.replica_id], float(get(s)))
            return c

        yield gauge("pool_running_requests", "Requests running in the engine", lambda s: s.engine.running)
        yield gauge(
            "pool_waiting_requests", "Requests waiting in the engine (incl. for remote KV)", lambda s: s.engine.waiting
        )
        yield gauge("pool_kv_blocks_total", "KV blocks in the pool", lambda s: s.engine.kv_blocks_total)
        yield gauge("pool_kv_blocks_used", "KV blocks referenced by requests", lambda s: s.engine.kv_blocks_used)
        yield gauge("pool_kv_usage", "Fraction of KV blocks in use", lambda s: s.kv_usage)
        yield gauge(
            "pool_prefix_cache_hit_rate",
            "Prefix-cache block hits / queries since start",
            lambda s: s.engine.prefix_hits / s.engine.prefix_queries if s.engine.prefix_queries else 0.0,
        )
        yield counter("pool_preemptions", "Requests preempted by recompute", lambda s: s.engine.preemptions)
        # Busy time: step_seconds / wall time is the engine's utilisation; wall minus CPU inside steps is time
        # the engine thread waited for a core or the GIL (other threads of the replica, other processes).
        yield counter("engine_steps", "Engine steps run", lambda s: s.engine.steps)
        yield counter("engine_step_seconds", "Wall seconds the engine spent in steps", lambda s: s.engine.step_seconds)
        yield counter(
            "engine_step_cpu_seconds",
            "CPU seconds of the engine thread in steps (torch's worker threads not counted)",
            lambda s: s.engine.step_cpu_seconds,
        )
        yield gauge(
            "pool_queued_prefill_tokens", "Prompt tokens not yet computed", lambda s: s.engine.queued_prefill_tokens
        )
        yield gauge("batch_num_seqs", "Sequences in the last step", lambda s: s.engine.geometry.num_seqs)
        yield gauge("batch_num_tokens", "Tokens computed in the last step", lambda s: s.engine.geometry.num_tokens)
        yield gauge(
            "batch_prefill_fraction",
            "Prompt share of the last step's tokens",
            lambda s: s.engine.geometry.prefill_fraction,
        )
        yield gauge(
            "batch_length_cv", "Coefficient of variation of running lengths", lambda s: s.engine.geometry.length_cv
        )
        yield gauge(
            "batch_max_min_ratio", "Longest / shortest running sequence", lambda s: s.engine.geometry.max_min_ratio
        )
        yield gauge(
            "batch_kv_footprint_bytes",
            "KV bytes held by running sequences",
            lambda s: s.engine.geometry.kv_footprint_bytes,
        )
        fmt = GaugeMetricFamily(
            "shapeserve_pool_kv_format_info", "KV page format each replica serves", labels=[*labels, "dtype"]
        )
        for s in stats:
            fmt.add_metric([s.pool, s.replica_id, s.engine.kv_dtype], 1.0)
        yield fmt
        yield counter("kv_transfers", "KV transfers completed", lambda s: s.transfers.transfers)
        yield counter("kv_transfer_bytes", "KV bytes moved between pools", lambda s: s.transfers.transfer_bytes)
        yield counter(
            "kv_transfer_seconds", "Seconds spent in KV transfers (sum)", lambda s: s.transfers.transfer_seconds
        )
        yield counter(
            "kv_transfer_failures",
            "Failed or timed-out KV transfers / prefills",
            lambda s: s.transfers.transfer_failures,
        )
        yield counter("prefill_retries", "Prefills retried on another replica", lambda s: s.transfers.prefill_retries)
        yield counter(
            "local_prefill_fallbacks", "Remote prefills that fell back to local", lambda s: s.transfers.local_fallbacks
        )


@dataclass
class RequestTiming:
    """Client-side timestamps of one request (monotonic seconds), filled in by the router."""

    arrival: float
    route: str
    started: float | None = None  # the decode replica accepted it
    first_token: float | None = None
    last_token: float | None = None
    num_output_tokens: int = 0


#: The families the edge observes on the request path (``RouterMetrics``); the pool families come from replica stats.
REQUEST_FAMILIES: tuple[MetricSpec, ...] = (
    MetricSpec(
        "shapeserve_time_to_first_token_seconds", "TTFT at the router", "histogram", ("route",), _LATENCY_BUCKETS
    ),
    MetricSpec(
        "shapeserve_time_per_output_token_seconds",
        "Mean time per output token after the first",
        "histogram",
        ("route",),
        _TOKEN_BUCKETS,
    ),
    MetricSpec(
        "shapeserve_inter_token_latency_seconds", "Gap between streamed tokens", "histogram", ("route",), _TOKEN_BUCKETS
    ),
    MetricSpec(
        "shapeserve_e2e_request_latency_seconds", "Arrival to last token", "histogram", ("route",), _LATENCY_BUCKETS
    ),
    MetricSpec(
        "shapeserve_queue_time_seconds",
        "Arrival until a decode replica took the request",
        "histogram",
        ("route",),
        _LATENCY_BUCKETS,
    ),
    MetricSpec("shapeserve_requests", "Finished requests", "counter", ("route", "outcome")),
    MetricSpec("shapeserve_goodput_requests", "Requests meeting the TTFT and TPOT SLOs", "counter", ("route",)),
    # Every series a dashboard charts exists from the first scrape, at 0 (a labelled counter is exported only
    # once a label value is used, so a panel of 429s would read "no data" until the first one).
    MetricSpec(
        "shapeserve_rejected_requests",
        "429s by the class whose budget was full",
        "counter",
        ("route_class",),
        zero_series=(("local",), ("remote",)),
    ),
    MetricSpec(
        "shapeserve_request_errors",
        "Requests answered with an error",
        "counter",
        ("status",),
        zero_series=(("429",), ("500",), ("503",), ("504",)),
    ),
    MetricSpec("shapeserve_prompt_tokens", "Prompt tokens of served requests", "counter", ("route",)),
    MetricSpec("shapeserve_generation_tokens", "Generated tokens", "counter", ("route",)),
)


class _Families:
    """A fixed list of families as a collector (one render's snapshot)."""

    def __init__(self, families: Iterable[Metric]):
        self._families = list(families)

    def collect(self):
        return iter(self._families)


class RouterMetrics:
    """What the edge observes on the request path, and the ``/metrics`` page.

    ``scope="replica"``: recorded in this process's own registry, the page shows this replica's requests (tests,
    run-batch, a server of one replica). ``scope="cluster"``: recorded through Ray's metrics pipeline and read
    back summed over every replica of the cluster (``cluster.serving.ray_metrics``), so every replica's page is
    the whole cluster's; needs a connected Ray worker."""

    def __init__(
        self,
        slo: SLOConfig,
        stats_source: Callable[[], Iterable[ReplicaStats]] | None = None,
        model_name: str = "",
        scope: str = "replica",
        cluster_reader: ClusterMetricsReader | None = None,
    ):
        self.slo = slo
        self.model_name = model_name
        self.stats_source = stats_source
        family: dict[str, Any]  # each with prometheus_client's ``labels(*values).observe / .inc``
        if scope == "cluster":
            self.reader: ClusterMetricsReader | None = cluster_reader or ClusterMetricsReader(REQUEST_FAMILIES)
            self._own: CollectorRegistry | None = None
            family = {s.name: RayFamily(s) for s in REQUEST_FAMILIES}
        elif scope == "replica":
            self.reader = None
            self._own = CollectorRegistry(auto_describe=True)
            family = {s.name: _local_family(s, self._own) for s in REQUEST_FAMILIES}
        else:
            raise ValueError(f"metrics scope must be 'replica' or 'cluster', not {scope!r}")
        self.ttft = family["shapeserve_time_to_first_token_seconds"]
        self.tpot = family["shapeserve_time_per_output_token_seconds"]
        self.itl = family["shapeserve_inter_token_latency_seconds"]
        self.e2e = family["shapeserve_e2e_request_latency_seconds"]
        self.queue = family["shapeserve_queue_time_seconds"]
        self.requests = family["shapeserve_requests"]
        self.good = family["shapeserve_goodput_requests"]
        self.rejected = family["shapeserve_rejected_requests"]
        self.errors = family["shapeserve_request_errors"]
        self.prompt_tokens = family["shapeserve_prompt_tokens"]
        self.generation_tokens = family["shapeserve_generation_tokens"]

    def request_families(self) -> dict[str, Metric]:
        """The request families as this scope sees them, by name (the cluster scope reads every node: blocking)."""
        if self.reader is not None:
            return self.reader.families()
        assert self._own is not None
        return {f.name: f for f in self._own.collect()}

    def observe_token(self, t: RequestTiming, now: float, n: int = 1) -> None:
        if t.first_token is None:
            t.first_token = now
            self.ttft.labels(t.route).observe(now - t.arrival)
        elif t.last_token is not None:
            self.itl.labels(t.route).observe(now - t.last_token)
        t.last_token = now
        t.num_output_tokens += n

    def observe_finished(self, t: RequestTiming, outcome: str, num_prompt_tokens: int) -> None:
        route = t.route
        self.requests.labels(route, outcome).inc()
        if t.started is not None:
            self.queue.labels(route).observe(t.started - t.arrival)
        if outcome != "ok" or t.first_token is None or t.last_token is None:
            return
        self.e2e.labels(route).observe(t.last_token - t.arrival)
        self.prompt_tokens.labels(route).inc(num_prompt_tokens)
        self.generation_tokens.labels(route).inc(t.num_output_tokens)
        ttft = t.first_token - t.arrival
        tpot = (t.last_token - t.first_token) / (t.num_output_tokens - 1) if t.num_output_tokens > 1 else 0.0
        if t.num_output_tokens > 1:
            self.tpot.labels(route).observe(tpot)
        if ttft * 1000 <= self.slo.ttft_ms and tpot * 1000 <= self.slo.tpot_ms:
            self.good.labels(route).inc()

    def render(self) -> bytes:
        """The page: the request families, the pool families from replica stats, and the vLLM names of both
        (the cluster scope reads every node's Ray endpoint: call it off the event loop)."""
        families = self.request_families()
        stats = self.stats_source or (lambda: ())
        page = CollectorRegistry(auto_describe=False)
        page.register(_Families(families.values()))
        if self.stats_source is not None:
            page.register(PoolStatsCollector(self.stats_source))
        page.register(VLLMNamesCollector(families, self.model_name, stats))
        return generate_latest(page)


def _local_family(spec: MetricSpec, registry: CollectorRegistry) -> Histogram | Counter:
    if spec.kind == "histogram":
        return Histogram(spec.name, spec.doc, spec.labels, buckets=spec.buckets, registry=registry)
    counter = Counter(spec.name, spec.doc, spec.labels, registry=registry)
    for values in spec.zero_series:
        counter.labels(*values)
    return counter


class VLLMNamesCollector:
    """The series a vLLM dashboard charts, under vLLM's names with a ``model_name`` label, rendered at scrape
    time from the same histograms, counters and replica stats as the ``shapeserve_*`` families (nothing is
    observed twice on the request path). The mapping is the table in docs/metrics.md."""

    #: vLLM histogram -> ours (both in seconds; ours keep their ``route`` label next to ``model_name``).
    HISTOGRAMS = {
        "vllm:time_to_first_token_seconds": "shapeserve_time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds": "shapeserve_inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds": "shapeserve_e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds": "shapeserve_queue_time_seconds",
    }
    COUNTERS = {
        "vllm:prompt_tokens": "shapeserve_prompt_tokens",
        "vllm:generation_tokens": "shapeserve_generation_tokens",
    }

    def __init__(self, families: Mapping[str, Metric], model_name: str, stats: Callable[[], Iterable[ReplicaStats]]):
        self.families = families
        self.model_name = model_name
        self.stats = stats

    def _renamed(self, name: str, kind: str, family: Metric) -> Metric:
        """``family``'s samples under ``name`` (its suffixes kept: _bucket, _count, _sum, _total), with
        ``model_name`` added to their labels."""
        out = Metric(name, f"{family.documentation} (vLLM name)", kind)
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            suffix = sample.name[len(family.name) :]
            out.add_sample(name + suffix, {"model_name": self.model_name, **sample.labels}, sample.value)
        return out

    def collect(self):
        for name, ours in self.HISTOGRAMS.items():
            yield self._renamed(name, "histogram", self.families[ours])
        for name, ours in self.COUNTERS.items():
            yield self._renamed(name, "counter", self.families[ours])
        success = Metric("vllm:request_success", "Requests that finished without an error (vLLM name)", "counter")
        for sample in self.families["shapeserve_requests"].samples:
            if sample.name.endswith("_total") and sample.labels.get("outcome") == "ok":
                labels = {"model_name": self.model_name, "route": sample.labels["route"]}
                success.add_sample("vllm:request_success_total", labels, sample.value)
        yield success
        decode = [s for s in self.stats() if s.pool == "decode"]

        def per_replica(name: str, doc: str, kind: str, get) -> Metric:
            family = Metric(name, f"{doc} (vLLM name)", kind)
            for s in decode:
                labels = {"model_name": self.model_name, "engine": s.replica_id}
                family.add_sample(name + ("_total" if kind == "counter" else ""), labels, float(get(s)))
            return family

        yield per_replica(
            "vllm:num_requests_running", "Requests running in the engine", "gauge", lambda s: s.engine.running
        )
        yield per_replica(
            "vllm:num_requests_waiting", "Requests waiting in the engine", "gauge", lambda s: s.engine.waiting
        )
        yield per_replica("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use", "gauge", lambda s: s.kv_usage)
        yield per_replica(
            "vllm:prefix_cache_queries",
            "Prefix-cache queries, in KV blocks",
            "counter",
            lambda s: s.engine.prefix_queries,
        )
        yield per_replica(
            "vllm:prefix_cache_hits", "Prefix-cache hits, in KV blocks", "counter", lambda s: s.engine.prefix_hits
        )
        yield per_replica("vllm:num_preemptions", "Requests preempted", "counter", lambda s: s.engine.preemptions)
