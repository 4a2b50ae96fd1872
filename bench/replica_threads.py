"""Where the decode replica's CPU goes under load: the engine (its step thread and torch's OpenMP workers)
against everything else in the process (the HTTP edge's event loop, Serve's and Ray's threads).

    python -m bench.replica_threads [--rate 2] [--workload skewed-64] [--repeats 3]

Starts ``shapeserve serve`` on the bench model (hidden 512, 8 layers, vocab 32000, float32), then per
repeat runs the workload at ``--rate`` (a new seed each) and reads, before and after, every thread's CPU
time from /proc/<pid>/task (the engine thread names itself "engine-loop"; the OpenMP workers it starts
inherit the name) and the engine's step counters from /metrics. Prints min / median / max over repeats.
Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil

from bench.engine_throughput import BENCH_SPEC
from bench.server_process import ServerProcess, machine_line
from cluster.tools.demo_model import ensure_demo_model
from cluster.tools.loadgen import report, run_load
from cluster.tools.workloads import load_workload

ENGINE_THREAD = "engine-loop"


def thread_cpu_s(pid: int) -> dict[tuple[str, str], float]:
    """(tid, OS thread name) -> user + system CPU seconds, for every thread of ``pid``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[(task.name, name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def engine_counters(url: str) -> tuple[float, float]:
    """(steps, wall seconds in steps) of the decode replica, from its /metrics page."""
    text = httpx.get(f"{url}/metrics", timeout=10).text

    def value(name: str) -> float:
        m = re.search(rf"^{name}\{{[^}}]*pool=\"decode\"[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
        if m is None:
            raise RuntimeError(f"{name} is not on {url}/metrics")
        return float(m.group(1))

    return value("shapeserve_engine_steps_total"), value("shapeserve_engine_step_seconds_total")


def decode_replica(server: ServerProcess) -> psutil.Process:
    if server.proc is None:
        raise RuntimeError("the server is not running")
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        if "DecodeWorker" in " ".join(p.cmdline()):
            return p
    raise RuntimeError("no decode replica process under the server")


def summary(label: str, xs: list[float], digits: int = 2) -> str:
    cells = " ".join(f"{v:9.{digits}f}" for v in (min(xs), statistics.median(xs), max(xs)))
    return f"{label:52} {cells}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="skewed-64")
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", default=".bench-models/llama-512h-8l")
    ap.add_argument("--port", type=int, default=8127)
    args = ap.parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit("bench.replica_threads reads /proc: Linux only")

    model_dir = str(ensure_demo_model(args.model_dir, BENCH_SPEC))
    print(f"machine: {machine_line()}")
    url = f"http://127.0.0.1:{args.port}"
    server = ServerProcess(
        [sys.executable, "-m", "cluster.tools.cli", "serve", "--model", model_dir, "--port", str(args.port)],
        url,
        "/tmp/shapeserve-replica-threads.log",
    ).start()
    rows: dict[str, list[float]] = {}
    try:
        replica = decode_replica(server)
        spec, warm = load_workload(args.workload, BENCH_SPEC.vocab_size, rate_per_s=args.rate, num_requests=4)
        asyncio.run(run_load(f"{url}/v1", Path(model_dir).name, warm, 600, False))
        for k in range(args.repeats):
            _, requests = load_workload(
                args.workload, BENCH_SPEC.vocab_size, rate_per_s=args.rate, seed=spec["seed"] + 1000 * (k + 1)
            )
            time.sleep(1.5)  # the replica's stats reach its /metrics page once per routing-stats period
            before, counters0 = thread_cpu_s(replica.pid), engine_counters(url)
            records, duration = asyncio.run(run_load(f"{url}/v1", Path(model_dir).name, requests, 600, False))
            after = thread_cpu_s(replica.pid)
            time.sleep(1.5)
            counters1 = engine_counters(url)
            result = report(records, duration, spec)["all"]
            engine = other = 0.0
            for key, cpu in after.items():
                delta = cpu - before.get(key, 0.0)
                if key[1] == ENGINE_THREAD:
                    engine += delta
                else:
                    other += delta
            tokens = result["output_tokens"]
            steps = counters1[0] - counters0[0]
            for label, value in (
                ("output tok/s", result["output_throughput"]),
                ("mean TPOT, ms", result["tpot_s"]["mean"] * 1000),
                ("median TTFT, ms", result["ttft_s"]["p50"] * 1000),
                ("run wall time, s", duration),
                ("engine CPU s (step thread + its OpenMP workers)", engine),
                ("rest of the replica CPU s (HTTP edge, Serve, Ray)", other),
                ("rest of the replica, ms per output token", other / tokens * 1000),
                ("engine steps", steps),
                ("mean step wall, ms", (counters1[1] - counters0[1]) / steps * 1000 if steps else 0.0),
                ("engine busy (step wall / run wall)", (counters1[1] - counters0[1]) / duration),
            ):
                rows.setdefault(label, []).append(value)
    finally:
        server.stop()
    print(f"\n{args.workload} at {args.rate} req/s, {args.repeats} repeats; decode replica of shapeserve serve")
    print(f"{'':52} {'min':>9} {'median':>9} {'max':>9}")
    for label, values in rows.items():
        print(summary(label, values, 0 if label == "engine steps" else 2))


if __name__ == "__main__":
    main()
