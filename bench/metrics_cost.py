"""What the metrics cost on the hot path, against what a token costs the engine, in one run.

    python -m bench.metrics_cost [--repeats 5] [--output-tokens 128]

1. The request path's observations, as the edge makes them (``RouterMetrics.observe_token`` once per engine
   step a request is in, ``observe_finished`` once per request), timed over many simulated requests of
   ``--output-tokens`` tokens: CPU microseconds per output token.
   The same in the cluster scope of a serving replica (``scope="cluster"``: recorded through Ray's metrics
   pipeline, in a local Ray this bench starts), the recording's CPU in the core worker's threads included.
2. One ``/metrics`` render (a scrape) with 8 replicas' stats, in milliseconds; at one scrape per 15 s. In the
   cluster scope the render reads the node's Ray metrics endpoint (wall time).
3. Request tracing (``cluster.serving.tracing``) as the edge and the decode worker call it for a REMOTE
   request (the root and admission spans, the decode side's queue / remote-prefill / decode spans, the prefill
   side's three), off (the default: no exporter configured) and on (an SDK provider with a batching processor
   whose exporter drops the spans, so only our side and the SDK's are counted): CPU microseconds per output
   token, background export thread included.
4. The baseline, measured in the same run: the offline engine's wall time per output token on the bench model
   (hidden 512, 8 layers, vocab 32000, float32; 32 prompts of 64 tokens, ``--output-tokens`` each).

The metrics run on the replica's event loop beside the engine, so their CPU per token over the engine's time per
token bounds the throughput they can take. Prints min / median / max over ``--repeats``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from bench.engine_throughput import BENCH_SPEC
from bench.server_process import machine_line
from cluster.config import CacheConfig, EngineConfig, SamplingParams
from cluster.serving.config import SLOConfig
from cluster.serving.messages import EngineStats, ReplicaStats
from cluster.serving.metrics import RequestTiming, RouterMetrics
from cluster.tools.demo_model import ensure_demo_model


def observe_us_per_token(output_tokens: int, scope: str = "replica", requests: int = 2000) -> float:
    m = RouterMetrics(SLOConfig(), model_name="bench", scope=scope)
    t0 = time.process_time()
    now = 0.0
    for i in range(requests):
        timing = RequestTiming(arrival=now, route="local" if i % 2 else "remote", started=now + 0.001)
        for _ in range(output_tokens):
            now += 0.02
            m.observe_token(timing, now, 1)
        m.observe_finished(timing, "ok", 64)
    return (time.process_time() - t0) / (requests * output_tokens) * 1e6


def render_ms(scope: str = "replica", replicas: int = 8, scrapes: int = 50) -> float:
    stats = [
        ReplicaStats(
            pool="decode" if i % 2 else "prefill", replica_id=f"r{i}", healthy=True, pid=i, engine=EngineStats()
        )
        for i in range(replicas)
    ]
    m = RouterMetrics(SLOConfig(), stats_source=lambda: stats, model_name="bench", scope=scope)
    timing = RequestTiming(arrival=0.0, route="local", started=0.001)
    for k in range(100):
        m.observe_token(timing, 0.01 * (k + 1))
    m.observe_finished(timing, "ok", 64)
    # The cluster scope's page waits for the node's Ray endpoint (an HTTP read): wall time, not only our CPU.
    clock = time.perf_counter if scope == "cluster" else time.process_time
    t0 = clock()
    for _ in range(scrapes):
        m.render()
    return (clock() - t0) / scrapes * 1e3


class _Dropped:
    """A span exporter that drops what it is given (the SDK's work up to the export is what is timed)."""

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def tracing_us_per_token(output_tokens: int, enabled: bool, requests: int = 1000) -> float:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from cluster.engine.llm_engine import RequestOutput
    from cluster.serving import tracing
    from decode_workers.request_spans import RequestSpans

    provider = None
    if enabled:
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(_Dropped()))  # type: ignore[arg-type]
    tracing.use_provider(provider)

    def output(n: int, scheduled: float | None, finished: bool) -> RequestOutput:
        return RequestOutput("r", (5,), "a", (), finished, "length" if finished else None, 64, n, 0, None, (), None,
                             scheduled)  # fmt: skip

    # Built before the clock starts: the engine makes them whether or not anything traces.
    outputs = [(output(1, None, False),)] + [
        (output(n, None, n == output_tokens),) for n in range(2, output_tokens + 1)
    ]
    t0 = time.process_time()
    for i in range(requests):
        trace = tracing.RequestTrace("/v1/completions", time.time_ns(), {"shapeserve.request_id": f"cmpl-{i}"})
        trace.admission(time.time_ns(), {"shapeserve.route": "remote"})
        trace.run_started()
        spans = RequestSpans(trace.context)
        spans.waited_for_blocks()
        # the decode side's prefill attempt, and the prefill replica's spans under it
        attempt = tracing.start_child("shapeserve.remote_prefill", trace.context, attributes={"attempt": 0})
        remote = tracing.context_of(attempt)
        now = time.time_ns()
        tracing.record("shapeserve.queue", remote, now, now)
        tracing.record("shapeserve.prefill", remote, now, now, {"shapeserve.prompt_tokens": 64})
        tracing.record("shapeserve.kv_transfer", remote, now, now, {"shapeserve.kv_bytes": 1 << 20})
        tracing.end(attempt, attributes={"shapeserve.kv_bytes": 1 << 20})
        for batch in outputs:
            spans.outputs(batch)
        spans.end()
        trace.run_ended("ok", "remote", output_tokens)
    if provider is not None:
        provider.shutdown()  # the export thread's work is in this process's CPU time too
    tracing.use_provider(None)
    return (time.process_time() - t0) / (requests * output_tokens) * 1e6


def engine_us_per_token(model_dir: str, output_tokens: int) -> float:
    from cluster.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(num_blocks=2048)))
    rng = random.Random(0)
    prompts = [[rng.randrange(4, BENCH_SPEC.vocab_size) for _ in range(64)] for _ in range(32)]
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm up
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    return (time.perf_counter() - t0) / (len(prompts) * output_tokens) * 1e6


def _spread(values: list[float]) -> list[float]:
    return [min(values), statistics.median(values), max(values)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--model-dir", default=".bench-models/llama-512h-8l")
    args = ap.parse_args()
    model_dir = str(ensure_demo_model(args.model_dir, BENCH_SPEC))
    print(machine_line())
    import ray

    # The cluster scope records through a Ray worker: this process, connected to a local Ray (idle beside us).
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    print("a local Ray runs beside the bench (idle), for the cluster scope's recording")
    rows: dict[str, list[float]] = {
        "metrics us/token": [],
        "cluster metrics us/token": [],
        "render ms/scrape": [],
        "cluster render ms/scrape": [],
        "tracing off us/token": [],
        "tracing on us/token": [],
        "engine us/token": [],
    }
    for _ in range(args.repeats):
        rows["metrics us/token"].append(observe_us_per_token(args.output_tokens))
        rows["cluster metrics us/token"].append(observe_us_per_token(args.output_tokens, scope="cluster"))
        rows["render ms/scrape"].append(render_ms())
        rows["cluster render ms/scrape"].append(render_ms(scope="cluster"))
        rows["tracing off us/token"].append(tracing_us_per_token(args.output_tokens, enabled=False))
        rows["tracing on us/token"].append(tracing_us_per_token(args.output_tokens, enabled=True))
        rows["engine us/token"].append(engine_us_per_token(model_dir, args.output_tokens))
    print(f"\n{'':32} {'min':>9} {'median':>9} {'max':>9}")
    for name, values in rows.items():
        print(f"{name:32} {min(values):9.2f} {statistics.median(values):9.2f} {max(values):9.2f}")
    for name in ("metrics", "cluster metrics", "tracing off", "tracing on"):
        share = [m / e for m, e in zip(rows[f"{name} us/token"], rows["engine us/token"], strict=True)]
        print(f"{name + ' / engine time per token':32} " + " ".join(f"{100 * v:8.3f}%" for v in _spread(share)))
    shares = [m / e for m, e in zip(rows["cluster metrics us/token"], rows["engine us/token"], strict=True)]
    engine_us = statistics.median(rows["engine us/token"])
    scrape_share = statistics.median(rows["cluster render ms/scrape"]) * 1e3 / 15e6  # one scrape per 15 s
    print(
        f"\nrequest-path metrics as served (cluster scope): {100 * statistics.median(shares):.2f}% of the engine's "
        f"{engine_us:.0f} us per token (median); one scrape every 15 s: {100 * scrape_share:.3f}% of the time; "
        "target <= 2% of online throughput"
    )
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
