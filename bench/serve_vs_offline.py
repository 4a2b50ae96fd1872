"""Online serving against the offline engine, in one run: throughput, latency, and where the CPU goes.

    python -m bench.serve_vs_offline [--workload skewed-64] [--rates inf] [--repeats 3]

For each repeat (a different workload seed: the same shapes, prompts no cache has seen) and each ``--rates``
value (``inf``: all at once; else Poisson arrivals at that rate):
  1. the offline engine (``LLMEngine`` in a fresh process, same model, same engine settings as the
     server's decode replica, same torch threads) gets the requests at their arrival times;
  2. ``shapeserve serve`` (started once, its own local Ray) gets the same requests at the same times over
     HTTP from ``shapeserve bench``'s client.
Prints output tokens/s of both and their ratio (min / median / max over the repeats); at a finite rate, both
sides' mean TPOT and median TTFT and their ratios (what serving adds to a request's latency); both engines'
step counts and mean step times (more steps for the same tokens: smaller batches; dearer steps: the rest of
the server slows the step); the server's latency percentiles, its CPU seconds per output token by process,
and the CPU it spends outside the model step: (server CPU - offline engine CPU for the same tokens) / output
tokens. Also the server's time to /health and its process tree's PSS. The client runs on the same machine.

The server runs with SLO admission off (``admission.admit_within_slo: false``, a config file written for the
run) unless ``--slo-admission``: the offline engine queues every request, and once the server has measured its
prefill rate, admission refuses the part of a 64-request burst whose predicted time to first token is past the
2 s SLO (429 + Retry-After; ``python -m bench.overload`` measures that policy). What this bench measures is the
serving path's cost, so both sides serve every request. The 429s are counted and printed either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.engine_throughput import BENCH_SPEC
from bench.server_process import ServerProcess, cpu_delta, machine_line
from cluster.serving.config import ServeConfig
from cluster.tools.demo_model import ensure_demo_model
from cluster.tools.loadgen import report, run_load
from cluster.tools.workloads import load_workload


def offline_once(model_dir: str, workload: str, seed: int, threads: int, rate: float) -> dict:
    """In a fresh process: the engine as the server's decode replica builds it, fed the requests the server
    gets at ``rate`` (the same prompts and arrival times; ``inf``: all at once)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.serve_vs_offline",
            "--offline-worker",
            json.dumps([model_dir, workload, seed, threads, rate]),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _offline_worker(model_dir: str, workload: str, seed: int, threads: int, rate: float) -> dict:
    from cluster.config import SamplingParams
    from cluster.engine.llm_engine import LLMEngine

    engine = LLMEngine(ServeConfig().engine_config("decode", model_dir, threads))
    _, reqs = load_workload(workload, BENCH_SPEC.vocab_size, rate_per_s=rate, seed=seed)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate([list(reqs[0].prompt_token_ids[:64])], warm)  # first-step costs, as the server's warm-up
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    produced: dict[str, int] = {}
    steps, step_s = 0, 0.0
    cpu0, t0 = time.process_time(), time.perf_counter()
    i = 0
    while i < len(reqs) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while i < len(reqs) and reqs[i].arrival_s <= now:
            r = reqs[i]
            params = SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(str(r.index), list(r.prompt_token_ids), params)
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, reqs[i].arrival_s - now))
            continue
        s0 = time.perf_counter()
        outputs = engine.step()
        t = time.perf_counter()
        steps, step_s = steps + 1, step_s + t - s0
        for o in outputs:
            if o.new_token_ids:
                first.setdefault(o.request_id, t - t0)
                last[o.request_id] = t - t0
                produced[o.request_id] = produced.get(o.request_id, 0) + len(o.new_token_ids)
    seconds = time.perf_counter() - t0
    tpot = [(last[r] - first[r]) / (produced[r] - 1) for r in first if produced[r] > 1]
    ttft = [first[str(r.index)] - r.arrival_s for r in reqs]
    return {
        "seconds": seconds,
        "cpu_s": time.process_time() - cpu0,
        "tokens": sum(produced.values()),
        "steps": steps,
        "step_s": step_s,
        "mean_tpot_s": statistics.mean(tpot),
        "median_ttft_s": statistics.median(ttft),
    }


def engine_counters(url: str) -> tuple[float, float]:
    """(steps, wall seconds in steps) of the server's engines so far, from its /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    steps = seconds = 0.0
    for line in text.splitlines():
        if line.startswith("shapeserve_engine_steps_total{"):
            steps += float(line.rsplit(" ", 1)[1])
        elif line.startswith("shapeserve_engine_step_seconds_total{"):
            seconds += float(line.rsplit(" ", 1)[1])
    return steps, seconds


def _no_slo_admission_config() -> str:
    path = Path(tempfile.mkdtemp(prefix="serve_vs_offline-")) / "no-slo-admission.yaml"
    path.write_text("shapeserve:\n  device: cpu\n  admission: {admit_within_slo: false}\n")
    return str(path)


def row(label: str, values: list[float], digits: int = 1) -> str:
    """A table row: ``label``, then min, median and max of ``values``."""
    cells = " ".join(f"{v:8.{digits}f}" for v in (min(values), statistics.median(values), max(values)))
    return f"{label:42} {cells}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="skewed-64")
    ap.add_argument("--rates", default="inf", help="comma-separated request rates for the server (inf: burst)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=2, help="torch threads of the offline engine (the server's come from its CPUs)"
    )
    ap.add_argument("--model-dir", default=".bench-models/llama-512h-8l")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra argument for shapeserve serve")
    ap.add_argument("--output-json", default=None)
    ap.add_argument(
        "--slo-admission", action="store_true", help="keep the server's SLO admission (default: off, see above)"
    )
    ap.add_argument("--offline-worker", default=None, help=argparse.SUPPRESS)  # offline_once's process
    args = ap.parse_args(argv)
    if args.offline_worker:
        print(json.dumps(_offline_worker(*json.loads(args.offline_worker))))
        return

    model_dir = str(ensure_demo_model(args.model_dir, BENCH_SPEC))
    rates = [float(r) for r in args.rates.split(",")]
    print(f"machine: {machine_line()}")
    print(f"server's SLO admission: {'on' if args.slo_admission else 'off (admission.admit_within_slo: false)'}")
    spec, _ = load_workload(args.workload, BENCH_SPEC.vocab_size)
    seeds = [spec["seed"] + 1000 * i for i in range(args.repeats)]

    server = ServerProcess(
        [
            sys.executable,
            "-m",
            "cluster.tools.cli",
            "serve",
            "--model",
            model_dir,
            "--port",
            str(args.port),
            *([] if args.slo_admission else ["--config", _no_slo_admission_config()]),
            *args.serve_arg,
        ],
        f"http://127.0.0.1:{args.port}",
        "/tmp/shapeserve-bench-server.log",
    ).start()
    # Each repeat runs the offline engine, then the server at every rate, back to back on one seed: a
    # shared machine's speed drifts, and the ratios compare runs that saw the same conditions.
    results: dict = {
        "offline": {str(r): [] for r in rates},
        "online": {str(r): [] for r in rates},
        "seconds_to_health": server.seconds_to_health,
    }
    try:
        for seed in seeds:
            for k, rate in enumerate(rates):
                # Each rate gets prompts of its own, which the server's prefix cache has not seen; the offline
                # engine gets the same prompts at the same arrival times, in a fresh process.
                offline = offline_once(model_dir, args.workload, seed + 100 * k, args.threads, rate)
                results["offline"][str(rate)].append(offline)
                _, requests = load_workload(args.workload, BENCH_SPEC.vocab_size, rate_per_s=rate, seed=seed + 100 * k)
                steps0 = engine_counters(server.url)
                before, client0 = server.cpu_seconds(), time.process_time()
                records, duration = asyncio.run(
                    run_load(f"{server.url}/v1", Path(model_dir).name, requests, 600, False)
                )
                cpu = cpu_delta(before, server.cpu_seconds())
                time.sleep(2.5 * ServeConfig().routing_stats_period_s)  # the replica's last stats reach the board
                steps1 = engine_counters(server.url)
                results["online"][str(rate)].append(
                    {
                        "report": report(records, duration, spec)["all"],
                        "cpu_s": cpu,
                        "client_cpu_s": time.process_time() - client0,
                        "steps": steps1[0] - steps0[0],
                        "step_s": steps1[1] - steps0[1],
                    }
                )
        results["pss_mb"] = server.pss_mb()
    finally:
        server.stop()

    print(f"\nworkload {args.workload}, {args.repeats} repeats (seeds {seeds}); model {Path(model_dir).name} float32")
    print(f"\n{'':42} {'min':>8} {'median':>8} {'max':>8}")
    for rate, runs in results["online"].items():
        offline = results["offline"][rate]
        off_tps = [o["tokens"] / o["seconds"] for o in offline]
        tps = [r["report"]["output_throughput"] for r in runs]
        print(f"rate={rate}")
        print(row("  offline engine, output tok/s", off_tps))
        print(row("  server, output tok/s", tps))
        print(row("  server / offline (same requests)", [t / o for t, o in zip(tps, off_tps, strict=True)], 2))
        print(row("  requests refused (429)", [r["report"]["rejected_429"] for r in runs], 0))
        if not math.isinf(float(rate)):
            # The same arrival times on both sides: the difference is what serving costs a request.
            for label, key, served_key in (
                ("mean TPOT", "mean_tpot_s", ("tpot_s", "mean")),
                ("median TTFT", "median_ttft_s", ("ttft_s", "p50")),
            ):
                off = [o[key] * 1000 for o in offline]
                served = [r["report"][served_key[0]][served_key[1]] * 1000 for r in runs]
                print(row(f"  offline engine {label}, ms", off))
                print(row(f"  server {label}, ms", served))
                print(row("  server / offline", [s_ / o for s_, o in zip(served, off, strict=True)], 2))
        # More steps for the same tokens: smaller batches; dearer steps at the same count: the step itself is
        # slowed (CPU taken by the rest of the server, the GIL, memory not yet touched).
        print(row("  offline engine steps", [o["steps"] for o in offline], 0))
        print(row("  server engine steps", [r["steps"] for r in runs], 0))
        print(row("  offline engine mean step, ms", [o["step_s"] / o["steps"] * 1000 for o in offline], 2))
        print(row("  server engine mean step, ms", [r["step_s"] / max(r["steps"], 1) * 1000 for r in runs], 2))
        for metric in ("ttft_s", "tpot_s", "itl_s"):
            for pct in ("mean", "p50", "p99"):
                vals = [r["report"][metric][pct] * 1000 for r in runs]
                print(row(f"  server {metric[:-2]} {pct}, ms", vals))
        tokens = [r["report"]["output_tokens"] for r in runs]
        groups = sorted({g for r in runs for g in r["cpu_s"]}, key=lambda g: -runs[0]["cpu_s"].get(g, 0.0))
        print("  server CPU per output token, ms, by process:")
        for g in groups:
            vals = [r["cpu_s"].get(g, 0.0) / t * 1000 for r, t in zip(runs, tokens, strict=True)]
            print(row(f"    {g}", vals, 3))
        client = [r["client_cpu_s"] / t * 1000 for r, t in zip(runs, tokens, strict=True)]
        print(row("  client (load generator) CPU, ms/token", client, 3))
        outside = [
            (sum(r["cpu_s"].values()) - o["cpu_s"] * t / o["tokens"]) / t * 1000
            for r, o, t in zip(runs, offline, tokens, strict=True)
        ]
        print(row("  CPU outside the model step, ms/token", outside, 3))
    print(
        f"\ntime to /health: {server.seconds_to_health:.1f} s; server PSS: {sum(results['pss_mb'].values()):.0f} MB "
        + ", ".join(f"{g} {mb:.0f}" for g, mb in sorted(results["pss_mb"].items(), key=lambda kv: -kv[1]))
    )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
