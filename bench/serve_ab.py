"""Two ``shapeserve serve`` setups against each other, one server at a time, in alternating order.

    python -m bench.serve_ab [--pairs 3] [--workload skewed-64] [--rate 2] \\
        [--a-rev REV] [--a-env KEY=VALUE ...] [--a-arg ARG ...] [--a-label NAME] \\
        [--b-rev REV] [--b-env KEY=VALUE ...] [--b-arg ARG ...] [--b-label NAME]

A side is a source tree (``--a-rev``: a git revision, checked out once into a worktree under
/tmp/shapeserve-serve-ab/, run with this repository's virtualenv; default: this working tree), environment
variables and extra ``shapeserve serve`` arguments. For every pair, each side in turn (A B, then B A in the
next pair: on this kind of VM, going first in a pair is itself an advantage or a handicap) gets:

  1. a fresh server (its own local Ray, the bench model, SLO admission off so both serve every request), timed
     to ``/health``, then one greedy request to warm it up;
  2. the workload at ``--rate`` requests/s (``inf``: all at once) from ``shapeserve bench``'s client, on
     prompts seeded by the pair (both sides of a pair get the same prompts; no server has seen them);
  3. the server's CPU seconds per output token (all its processes) and its process count; then it stops.

Prints min/median/max over the pairs for each side and the A/B ratio of the medians. A server that refused
or failed a request stops the benchmark: the sides must serve the same requests to be compared.

Only one server runs at a time, and nothing else should: a served TPOT on a 2-core machine moves by 10-15%
between single runs, so read the ratio of medians over several pairs, never one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.ab import alternate, print_ab_table
from bench.compare_servers import stop
from bench.engine_throughput import BENCH_SPEC
from bench.server_process import ServerProcess, cpu_delta, machine_line
from cluster.tools.demo_model import ensure_demo_model
from cluster.tools.loadgen import report, run_load
from cluster.tools.workloads import load_workload

REPO = Path(__file__).resolve().parent.parent
WORKTREES = Path(tempfile.gettempdir()) / "shapeserve-serve-ab"
ROWS = [
    "mean TPOT, ms",
    "p99 TPOT, ms",
    "median TTFT, ms",
    "output tok/s",
    "server CPU per output token, ms",
    "time to /health, s",
    "server processes",
]


@dataclass(frozen=True)
class Side:
    label: str
    tree: Path  # the source tree the server runs from
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()


def source_tree(rev: str | None) -> Path:
    """This checkout for ``None``; otherwise a worktree of ``rev`` (made once, reused: numba's cache stays warm)."""
    if rev is None:
        return REPO
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    tree = WORKTREES / commit[:12]
    if not tree.exists():
        WORKTREES.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], check=True)
    return tree


def parse_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--a-env/--b-env take KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def no_slo_admission_config() -> str:
    path = Path(tempfile.mkdtemp(prefix="serve_ab-")) / "no-slo-admission.yaml"
    path.write_text("shapeserve:\n  device: cpu\n  admission: {admit_within_slo: false}\n")
    return str(path)


def start(side: Side, model_dir: str, port: int, config: str) -> ServerProcess:
    # The side's tree first on the path of the CLI and of every Ray worker it starts (they inherit the variable).
    env = {**side.env, "PYTHONPATH": os.pathsep.join(filter(None, [str(side.tree), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "cluster.tools.cli", "serve", "--model", model_dir, "--port", str(port)]
    server = ServerProcess(
        [*cmd, "--config", config, *side.args],
        f"http://127.0.0.1:{port}",
        str(Path(tempfile.gettempdir()) / f"serve_ab-{side.label}.log"),
        env=env,
        cwd=str(side.tree),  # so that ``-m cluster.tools.cli`` is that tree's
    )
    return server.start(timeout_s=600)


def warm_up(url: str, model: str) -> None:
    body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="runs of each side (alternating order)")
    ap.add_argument("--workload", default="skewed-64")
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s (inf: all at once)")
    ap.add_argument("--model-dir", default=".bench-models/llama-512h-8l")
    ap.add_argument("--port", type=int, default=8125)
    for side in ("a", "b"):
        ap.add_argument(f"--{side}-rev", default=None, help=f"git revision side {side.upper()} runs (default: here)")
        ap.add_argument(f"--{side}-env", action="append", default=[], metavar="KEY=VALUE")
        ap.add_argument(f"--{side}-arg", action="append", default=[], help="extra argument for shapeserve serve")
        ap.add_argument(f"--{side}-label", default=side.upper())
    args = ap.parse_args(argv)

    # Absolute: a side's server runs from its own tree.
    model_dir = str(Path(ensure_demo_model(args.model_dir, BENCH_SPEC)).resolve())
    sides = {
        s.label: s
        for s in (
            Side(args.a_label, source_tree(args.a_rev), parse_env(args.a_env), tuple(args.a_arg)),
            Side(args.b_label, source_tree(args.b_rev), parse_env(args.b_env), tuple(args.b_arg)),
        )
    }
    if len(sides) != 2:
        raise SystemExit("--a-label and --b-label must differ")
    config = no_slo_admission_config()
    print(f"machine: {machine_line()}")
    for s in sides.values():
        print(f"side {s.label}: tree {s.tree}, env {s.env or '-'}, args {' '.join(s.args) or '-'}")
    spec, _ = load_workload(args.workload, BENCH_SPEC.vocab_size)
    print(f"workload {args.workload} at {args.rate} req/s; {args.pairs} pairs, order alternating", flush=True)

    current: dict[str, Any] = {}  # the server being measured and its side's label

    def use(label: str) -> None:
        server = start(sides[label], model_dir, args.port, config)
        warm_up(server.url, Path(model_dir).name)
        current["server"] = server
        current["label"] = label

    def measure(rng: random.Random) -> list[float]:
        server = current["server"]
        try:
            seed = spec["seed"] + rng.randrange(1, 10**6)
            _, requests = load_workload(args.workload, BENCH_SPEC.vocab_size, rate_per_s=args.rate, seed=seed)
            before = server.cpu_seconds()
            records, duration = asyncio.run(
                run_load(f"{server.url}/v1", Path(model_dir).name, requests, 600, progress=False)
            )
            cpu = sum(cpu_delta(before, server.cpu_seconds()).values())
            processes = len(server.tree())
        finally:
            stop(server, args.port)
        summary = report(records, duration, spec)["all"]
        if summary["completed"] != len(requests):
            raise SystemExit(
                f"side {current['label']} served {summary['completed']} of {len(requests)} requests "
                f"({summary['errors_by_status']}); see {server.log_path}"
            )
        print(
            f"    {current['label']}: TPOT mean {summary['tpot_s']['mean'] * 1e3:.1f} ms, "
            f"TTFT p50 {summary['ttft_s']['p50'] * 1e3:.0f} ms, {summary['output_throughput']:.0f} tok/s",
            flush=True,
        )
        return [
            summary["tpot_s"]["mean"] * 1e3,
            summary["tpot_s"]["p99"] * 1e3,
            summary["ttft_s"]["p50"] * 1e3,
            summary["output_throughput"],
            cpu / summary["output_tokens"] * 1e3,
            server.seconds_to_health or 0.0,
            float(processes),
        ]

    started = time.monotonic()
    results = alternate(list(sides), use, measure, ROWS, args.pairs, reverse_odd_repeats=True)
    a, b = list(sides)
    print_ab_table(results, ROWS, a, b)
    print(f"\n{time.monotonic() - started:.0f} s in all; ratio = {a} / {b} (medians)")


if __name__ == "__main__":
    main()
