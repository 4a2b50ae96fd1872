"""Overload through HTTP on a live ``shapeserve serve``: capacity measured first, then three times that
offered, the clients retrying once after Retry-After. Lean (about a minute); ``python -m bench.overload`` is the
longer run whose figures docs/benchmarks.md records."""

from __future__ import annotations

import asyncio

import pytest

from bench.overload import overload_phase
from cluster.tools.loadgen import goodput_until, run_load, summarize
from cluster.tools.workloads import WorkloadRequest, load_workload
from tests.integration.live_server import live_server

pytestmark = pytest.mark.slow

SLO = {"ttft_ms": 1500, "tpot_ms": 120}


def shapes(demo_model, count: int, rate: float, seed: int) -> list[WorkloadRequest]:
    """The overload workload's shapes, cut to the demo model's context (prompts 64-400, outputs 32-64 tokens)."""
    _, requests = load_workload("overload", 512, rate, count, seed=seed)
    return [
        WorkloadRequest(r.index, r.class_name, r.arrival_s, r.prompt_token_ids[:400], min(r.output_tokens, 64))
        for r in requests
    ]


@pytest.fixture(scope="module")
def server(demo_model, tmp_path_factory):
    config = f"device: cpu\nserved_model_name: demo\nslo: {{ttft_ms: {SLO['ttft_ms']}, tpot_ms: {SLO['tpot_ms']}}}"
    with live_server(demo_model, tmp_path_factory.mktemp("overload"), config) as proc:
        yield proc


def test_three_times_capacity_gets_fast_429s_and_keeps_goodput(server, demo_model):
    url = f"{server.url}/v1"
    asyncio.run(run_load(url, "demo", shapes(demo_model, 4, float("inf"), 1), 120, False))  # warm up
    # Capacity near saturation: at 6 in flight it read ~11 req/s on an AVX2 VM where the engine, batching wider,
    # served ~27 req/s; three times 11 was then no overload at all (no 429 in a CI run). 16 in flight read ~16.
    # 96 requests, not 32: on the AVX-512 VM 32 took about half a second and read 31-60 req/s from run to run, and a
    # high reading made the goodput check below compare against an outlier (a CI replica failed it at 0.87x); with
    # 96, three runs read 38-46.
    records, duration = asyncio.run(
        run_load(url, "demo", shapes(demo_model, 96, float("inf"), 2), 120, False, max_concurrency=16)
    )
    capacity = summarize(records, duration, SLO)
    assert capacity["failed"] == 0
    rate = 3 * capacity["request_throughput"]
    offered = shapes(demo_model, max(12, round(rate * 8)), rate, 3)
    records, (probes, probe_failures, worst), duration = asyncio.run(overload_phase(server.url, "demo", offered, 1))
    over = summarize(records, duration, SLO)
    # Goodput while the load was offered (late retries finish after it, and would dilute a per-phase rate).
    over["goodput"] = goodput_until(records, offered[-1].arrival_s, SLO)
    report = {k: over[k] for k in ("completed", "rejected_429", "retries", "retries_succeeded", "goodput")}
    report["capacity_goodput"] = capacity["goodput"]
    report["reject_p99_s"] = over["reject_latency_s"]["p99"]
    print(f"overload at 3x capacity: {report}")  # in CI's log: the margins of the assertions below
    # Nothing but 200s and 429s; no request lost or broken.
    assert set(over["errors_by_status"]) <= {"429"}, over["errors_by_status"]
    assert over["rejected_429"] > 0, report  # the excess was refused, not queued
    # Refused at once, not queued: a queued request waits for a running one to finish (seconds here). Usually
    # ~0.03 s; the bound leaves room for a client that shares two busy cores with the engine (once 0.109 s).
    assert over["reject_latency_s"]["p99"] < 0.25, over["reject_latency_s"]
    # What was admitted met the SLO: goodput under 3x load is no lower than at capacity (10% for the noise of
    # two short measurements on a shared machine).
    assert over["goodput"] >= capacity["goodput"] * 0.9, report
    assert over["retries_succeeded"] is not None and over["retries_succeeded"] >= 0.5, report
    assert probes > 0 and probe_failures == 0 and worst < 1.0, (probes, probe_failures, worst)
