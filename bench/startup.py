"""Time from ``shapeserve serve`` to ``/health`` 200, split into phases.

    python -m bench.startup [--repeats 3] [--model DIR]

Per repeat: starts ``shapeserve serve`` (its own local Ray) on the bench model (hidden 512, 8 layers,
vocab 32000, float32), polls /health every 0.1 s, then reads the decode replica's Serve log for when its
``__init__`` started and finished, and stops the server. Phases (wall clock):

- to the replica: the CLI, Ray's local start, Serve's start, the replica's process;
- the replica's init: torch and transformers imports, tokenizer, KV pool, weights, kernel probes;
- to /health: the replica's HTTP server and the first health check.

Prints min / median / max over repeats against the 15 s target; the machine line says what else ran.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

from bench.engine_throughput import BENCH_SPEC
from bench.server_process import ServerProcess, machine_line
from cluster.tools.demo_model import ensure_demo_model

TARGET_S = 15.0
_INIT = re.compile(r"^INFO (\S+ \S+) shapeserve_DecodeWorker \S+ -- (Started|Finished) initializing replica")


def replica_init_times(session_dir: Path) -> tuple[float, float]:
    """(started, finished) of the decode replica's ``__init__``, as Unix times, from its Serve log."""
    found: dict[str, float] = {}
    for log in (session_dir / "logs" / "serve").glob("replica_shapeserve_DecodeWorker_*.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = _INIT.match(line)
            if m:
                found[m.group(2)] = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    if set(found) != {"Started", "Finished"}:
        raise RuntimeError(f"no replica init lines in {session_dir}/logs/serve")
    return found["Started"], found["Finished"]


def one_start(model_dir: str, port: int, log_path: str) -> dict[str, float]:
    cmd = [sys.executable, "-m", "cluster.tools.cli", "serve", "--model", model_dir, "--port", str(port)]
    server = ServerProcess(cmd, f"http://127.0.0.1:{port}", log_path)
    t0 = time.time()
    server.start(timeout_s=300)
    t_health = time.time()
    try:
        started, finished = replica_init_times(Path("/tmp/ray/session_latest").resolve())
    finally:
        server.stop()
    return {
        "to /health 200": t_health - t0,
        "CLI + Ray + Serve + replica process": started - t0,
        "replica __init__": finished - started,
        "replica HTTP server + first check": t_health - finished,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", default=".bench-models/llama-512h-8l")
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--log", default="/tmp/shapeserve-startup.log")
    args = ap.parse_args()
    model_dir = str(ensure_demo_model(args.model_dir, BENCH_SPEC))
    print(machine_line())
    runs = []
    for i in range(args.repeats):
        run = one_start(model_dir, args.port, args.log)
        runs.append(run)
        print(f"repeat {i + 1}: " + ", ".join(f"{k} {v:.1f} s" for k, v in run.items()), flush=True)
        time.sleep(3)  # Ray's processes finish exiting
    print(f"\n{'phase, s':40} {'min':>6} {'median':>7} {'max':>6}")
    for key in runs[0]:
        values = [r[key] for r in runs]
        print(f"{key:40} {min(values):6.1f} {statistics.median(values):7.1f} {max(values):6.1f}")
    median = statistics.median(r["to /health 200"] for r in runs)
    print(f"\nmedian time to /health {median:.1f} s = {median / TARGET_S:.2f}x the {TARGET_S:.0f} s target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
