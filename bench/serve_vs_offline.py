"""Online serving against the offline engine, in one run: throughput, latency, and where the CPU goes.

    python -m bench.serve_vs_offline [--workload skewed-64] [--rates inf] [--repeats 3]

For each repeat (a different workload seed: the same shapes, prompts no cache has seen):
  1. the offline engine (``LLMEngine`` in a fresh process, same model, same engine settings as the
     server's decode replica, same torch threads) runs the workload's requests all at once;
  2. ``shapeserve serve`` (started once, its own local Ray) gets the same requests over HTTP from
     ``shapeserve bench``'s client, at each ``--rates`` value (``inf``: all at once).
Prints output tokens/s of both and their ratio (min / median / max over the repeats), latency
percentiles, the server's CPU seconds per output token by process, and the CPU it spends outside
the model step: (server CPU - offline engine CPU for the same tokens) / output tokens. Also the
server's time to /health and its process tree's PSS. The client runs on the same machine.

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

from bench.engine_throughput import BENCH_SPEC
from bench.server_process import ServerProcess, cpu_delta, machine_line
from cluster.tools.demo_model import ensure_demo_model
from cluster.tools.loadgen import report, run_load
from cluster.tools.workloads import load_workload


def offline_once(model_dir: str, workload: str, seed: int, threads: int) -> dict:
    """In a fresh process: the engine as the server's decode replica builds it, the workload at once."""
    code = f"""
import json, time, torch
from cluster.serving.config import ServeConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.config import SamplingParams
from cluster.tools.workloads import load_workload
engine = LLMEngine(ServeConfig().engine_config("decode", {model_dir!r}, {threads}))
_, reqs = load_workload({workload!r}, {BENCH_SPEC.vocab_size}, seed={seed})
warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
engine.generate([list(reqs[0].prompt_token_ids[:64])], warm)  # first-step costs, as the server's warm-up
cpu0, t0 = time.process_time(), time.perf_counter()
for r in reqs:
    params = SamplingParams(max_tokens=r.output_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(str(r.index), list(r.prompt_token_ids), params)
tokens = 0
while engine.has_unfinished_requests():
    tokens += sum(len(o.new_token_ids) for o in engine.step())
print(json.dumps({{"seconds": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0, "tokens": tokens}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    args = ap.parse_args(argv)

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
    offline: list[dict] = []
    results: dict = {
        "offline": offline,
        "online": {str(r): [] for r in rates},
        "seconds_to_health": server.seconds_to_health,
    }
    try:
        for seed in seeds:
            offline.append(offline_once(model_dir, args.workload, seed, args.threads))
            for k, rate in enumerate(rates):
                # The first rate runs the offline engine's prompts; later ones get prompts of their own, which
                # the server's prefix cache has not seen.
                _, requests = load_workload(args.workload, BENCH_SPEC.vocab_size, rate_per_s=rate, seed=seed + 100 * k)
                before, client0 = server.cpu_seconds(), time.process_time()
                records, duration = asyncio.run(
                    run_load(f"{server.url}/v1", Path(model_dir).name, requests, 600, False)
                )
                cpu = cpu_delta(before, server.cpu_seconds())
                results["online"][str(rate)].append(
                    {
                        "report": report(records, duration, spec)["all"],
                        "cpu_s": cpu,
                        "client_cpu_s": time.process_time() - client0,
                    }
                )
        results["pss_mb"] = server.pss_mb()
    finally:
        server.stop()

    print(f"\nworkload {args.workload}, {args.repeats} repeats (seeds {seeds}); model {Path(model_dir).name} float32")
    off_tps = [o["tokens"] / o["seconds"] for o in offline]
    print(f"\n{'':42} {'min':>8} {'median':>8} {'max':>8}")
    print(row("offline engine, output tok/s", off_tps))
    for rate, runs in results["online"].items():
        tps = [r["report"]["output_throughput"] for r in runs]
        # The offline engine runs the burst: only the burst's server run does the same steps, so only it is
        # compared with it (paced arrivals make smaller batches, which cost the engine more per token).
        burst = math.isinf(float(rate))
        print(row(f"server rate={rate}, output tok/s", tps))
        if burst:
            print(row("  ratio to offline (same seed)", [t / o for t, o in zip(tps, off_tps, strict=True)], 2))
        print(row("  requests refused (429)", [r["report"]["rejected_429"] for r in runs], 0))
        for metric in ("ttft_s", "tpot_s", "itl_s"):
            for pct in ("mean", "p50", "p99"):
                vals = [r["report"][metric][pct] * 1000 for r in runs]
                print(row(f"  {metric[:-2]} {pct}, ms", vals))
        tokens = [r["report"]["output_tokens"] for r in runs]
        groups = sorted({g for r in runs for g in r["cpu_s"]}, key=lambda g: -runs[0]["cpu_s"].get(g, 0.0))
        print("  server CPU per output token, ms, by process:")
        for g in groups:
            vals = [r["cpu_s"].get(g, 0.0) / t * 1000 for r, t in zip(runs, tokens, strict=True)]
            print(row(f"    {g}", vals, 3))
        client = [r["client_cpu_s"] / t * 1000 for r, t in zip(runs, tokens, strict=True)]
        print(row("  client (load generator) CPU, ms/token", client, 3))
        if burst:
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
