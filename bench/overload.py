"""Overload: several times the measured capacity, answered with fast, honest 429s.

    python -m bench.overload [--multiple 3] [--capacity-requests 48] [--overload-s 60]

1. Starts ``shapeserve serve`` on the bench model with the workload's SLO (``../shared/workloads/overload.json``:
   TTFT 5 s, TPOT 300 ms) as the server's own, so admission keeps the targets the client measures.
2. Capacity, measured first in the same run: ``--capacity-requests`` of the workload's shapes, closed loop at
   ``--concurrency`` in flight: completed requests per second, and goodput (requests per second within the SLO).
3. Overload: Poisson arrivals at ``--multiple`` x that capacity for ``--overload-s`` seconds; a request
   answered 429 is sent again once, after its Retry-After; ``/health`` is polled every 0.5 s throughout.

Prints the capacity phase's and the overload phase's completed/s and goodput (the overload's over the
window its arrivals span, so that the late retries' tail does not dilute it; and over the whole phase), 5xx
and connection failures, how fast the 429s were answered (p50 / p99), the share of retries that were
served, and ``/health``'s worst latency and failures. ``--baseline`` runs it all a second time, in the same
invocation, with admission by the class budgets only (``admission.admit_within_slo: false``), to show what
the SLO prediction adds. What the issue asks of it: 0 5xx, 429s within 100 ms, >= 50% of retries served,
goodput under overload >= goodput at capacity, ``/health`` answering throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from bench.engine_throughput import BENCH_SPEC
from bench.server_process import ServerProcess, machine_line
from cluster.tools.demo_model import ensure_demo_model
from cluster.tools.loadgen import goodput_until, run_load, summarize
from cluster.tools.workloads import load_workload


async def poll_health(url: str, stop: asyncio.Event, period_s: float = 0.5) -> tuple[int, int, float]:
    """(probes, failed probes, worst latency in seconds) of ``/health`` until ``stop`` is set."""
    import aiohttp

    probes = failed = 0
    worst = 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                async with session.get(f"{url}/health") as resp:
                    await resp.read()
                    failed += resp.status != 200
            except Exception:  # noqa: BLE001 - a failed probe is the figure
                failed += 1
            worst = max(worst, time.perf_counter() - t)
            probes += 1
            await asyncio.sleep(period_s)
    return probes, failed, worst


async def overload_phase(url: str, model: str, requests, retries: int) -> tuple[list, tuple[int, int, float], float]:
    stop = asyncio.Event()
    health = asyncio.create_task(poll_health(url, stop))
    records, duration = await run_load(f"{url}/v1", model, requests, 600, False, retries_after_429=retries)
    stop.set()
    return records, await health, duration


def server_config(directory: Path, slo: dict, predict_ttft: bool) -> Path:
    path = directory / f"overload-{predict_ttft}.yaml"
    path.write_text(
        "shapeserve:\n  device: cpu\n"
        f"  slo: {{ttft_ms: {slo['ttft_ms']}, tpot_ms: {slo['tpot_ms']}}}\n"
        f"  admission: {{admit_within_slo: {str(predict_ttft).lower()}}}\n"
    )
    return path


def run_side(args, model_dir: str, spec: dict, predict_ttft: bool) -> None:
    slo = spec["slo"]
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(
            [sys.executable, "-m", "cluster.tools.cli", "serve", "--model", model_dir, "--port", str(args.port)]
            + ["--config", str(server_config(Path(tmp), slo, predict_ttft))],
            f"http://127.0.0.1:{args.port}",
            "/tmp/shapeserve-overload.log",
        ).start()
        try:
            model = Path(model_dir).name
            _, warm = load_workload(args.workload, BENCH_SPEC.vocab_size, float("inf"), 4, seed=spec["seed"] + 99)
            asyncio.run(run_load(f"{server.url}/v1", model, warm, 600, False))
            _, shapes = load_workload(
                args.workload, BENCH_SPEC.vocab_size, float("inf"), args.capacity_requests, seed=spec["seed"] + 1
            )
            records, duration = asyncio.run(
                run_load(f"{server.url}/v1", model, shapes, 600, False, max_concurrency=args.concurrency)
            )
            capacity = summarize(records, duration, slo)
            rate = capacity["request_throughput"] * args.multiple
            num = max(1, round(rate * args.overload_s))
            _, offered = load_workload(args.workload, BENCH_SPEC.vocab_size, rate, num, seed=spec["seed"] + 2)
            records, (probes, probe_failures, worst), duration = asyncio.run(
                overload_phase(server.url, model, offered, retries=1)
            )
            over = summarize(records, duration, slo)
            window = offered[-1].arrival_s
            over["goodput_in_window"] = goodput_until(records, window, slo)
        finally:
            server.stop()
    failures = {k: v for k, v in over["errors_by_status"].items() if k != "429"}
    print(f"\n== admission: {'TTFT and TPOT predicted against the SLO' if predict_ttft else 'class budgets only'}")
    print(
        f"capacity ({args.capacity_requests} requests, {args.concurrency} in flight): "
        f"{capacity['request_throughput']:.2f} completed/s, goodput {capacity['goodput']:.2f} req/s"
    )
    ratio = over["goodput_in_window"] / capacity["goodput"] if capacity["goodput"] else float("nan")
    print(
        f"overload ({args.multiple:g}x = {rate:.2f} req/s offered over {window:.0f} s): goodput in that window "
        f"{over['goodput_in_window']:.2f} req/s = {ratio:.2f}x capacity goodput; whole phase ({duration:.0f} s, "
        f"until the last retry): {over['request_throughput']:.2f} completed/s, goodput {over['goodput']:.2f} req/s"
    )
    lat = over["reject_latency_s"]
    served = f"{over['retries_succeeded']:.0%}" if over["retries_succeeded"] is not None else "-"
    print(
        f"429s: {over['rejected_429']}, answered in p50 {1000 * (lat['p50'] or 0):.1f} ms, "
        f"p99 {1000 * (lat['p99'] or 0):.1f} ms; retries after Retry-After: {over['retries']}, {served} served"
    )
    print(f"failures other than 429 (5xx, connection): {failures or 0}")
    print(f"/health: {probes} probes, {probe_failures} failed, worst {1000 * worst:.0f} ms")
    ttft, tpot = over["ttft_s"], over["tpot_s"]
    if ttft["p50"] is not None:
        print(
            f"admitted requests: TTFT p50 {ttft['p50']:.2f} s, p99 {ttft['p99']:.2f} s; "
            f"TPOT p50 {1000 * tpot['p50']:.0f} ms, p99 {1000 * tpot['p99']:.0f} ms"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="overload")
    ap.add_argument("--multiple", type=float, default=3.0, help="offered load over the measured capacity")
    ap.add_argument("--capacity-requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight while measuring capacity")
    ap.add_argument("--overload-s", type=float, default=60.0)
    ap.add_argument("--baseline", action="store_true", help="also run with admission by class budgets only")
    ap.add_argument("--model-dir", default=".bench-models/llama-512h-8l")
    ap.add_argument("--port", type=int, default=8131)
    args = ap.parse_args(argv)
    model_dir = str(ensure_demo_model(args.model_dir, BENCH_SPEC))
    print(f"machine: {machine_line()}")
    spec, _ = load_workload(args.workload, BENCH_SPEC.vocab_size)
    slo = spec["slo"]
    print(f"workload {args.workload}: SLO TTFT {slo['ttft_ms']} ms, TPOT {slo['tpot_ms']} ms (the server's too)")
    for predict_ttft in (True, False) if args.baseline else (True,):
        run_side(args, model_dir, spec, predict_ttft)
    return 0


if __name__ == "__main__":
    sys.exit(main())
