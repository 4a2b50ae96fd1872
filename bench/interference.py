"""Does disaggregation pay? Chat streams beside long documents, colocated vs disaggregated, same cores.

    python -m bench.interference [--workload interference] [--repeats 1]

Runs ``../shared/workloads/interference.json`` (Poisson chat traffic with occasional 1.4-1.9k-token
documents) against ``shapeserve serve`` twice per repeat, one after the other on the same machine:
``bench/configs/colocated.yaml`` (one engine prefills and decodes) and ``bench/configs/disaggregated.yaml``
(documents prefill on a prefill pool and their KV is pushed to the decode replica). Prints per class
TPOT / TTFT / ITL percentiles and throughput for both and the ratios disaggregated / colocated. The
chat class's p99 TPOT is the figure that says whether long prefills stall the streams.

A third side, "chat alone" (unless ``--no-floor``), is the colocated server given the same chat requests at
the same arrival times with the documents left out. No split of the same cores can stream the chats faster
than an engine that has all of them and no documents to prefill, so its chat figures over the colocated
ones are the floor of what disaggregation can reach on this machine: a target ratio below that floor cannot
be met here, whatever the pools do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

from bench.engine_throughput import BENCH_SPEC
from bench.server_process import ServerProcess, machine_line
from cluster.tools.demo_model import ensure_demo_model
from cluster.tools.loadgen import report, run_load
from cluster.tools.workloads import load_workload

CONFIGS = Path(__file__).resolve().parent / "configs"
SIDES = ("colocated", "disaggregated")
#: The side without the documents, and the class it keeps.
FLOOR_SIDE, FLOOR_CLASS = "chat alone", "chat"


def run_side(side: str, model_dir: str, workload: str, seed: int, port: int) -> dict:
    only_class = FLOOR_CLASS if side == FLOOR_SIDE else None
    config = "colocated" if side == FLOOR_SIDE else side
    server = ServerProcess(
        [sys.executable, "-m", "cluster.tools.cli", "serve", "--model", model_dir, "--port", str(port)]
        + ["--config", str(CONFIGS / f"{config}.yaml")],
        f"http://127.0.0.1:{port}",
        f"/tmp/shapeserve-interference-{side.replace(' ', '-')}.log",
    ).start()
    try:
        spec, requests = load_workload(workload, BENCH_SPEC.vocab_size, seed=seed)
        if only_class is not None:  # the same requests of that class at the same times; the others never sent
            requests = [r for r in requests if r.class_name == only_class]
        records, duration = asyncio.run(run_load(f"{server.url}/v1", Path(model_dir).name, requests, 600, False))
        return report(records, duration, spec)
    finally:
        server.stop()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="interference")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model-dir", default=".bench-models/llama-512h-8l")
    ap.add_argument("--port", type=int, default=8124)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--no-floor", action="store_true", help=f"skip the '{FLOOR_SIDE}' side (the documents left out)")
    args = ap.parse_args(argv)
    sides = SIDES if args.no_floor else (*SIDES, FLOOR_SIDE)
    model_dir = str(ensure_demo_model(args.model_dir, BENCH_SPEC))
    print(f"machine: {machine_line()}")
    spec, _ = load_workload(args.workload, BENCH_SPEC.vocab_size)
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for i in range(args.repeats):
        for side in sides:
            runs[side].append(run_side(side, model_dir, args.workload, spec["seed"] + 1000 * i, args.port))

    def med(side: str, section: str, metric: str, pct: str | None = None) -> float:
        values = []
        for r in runs[side]:
            s = r["all"] if section == "all" else r["by_class"][section]
            values.append(s[metric][pct] if pct else s[metric])
        return statistics.median(values)

    floor = FLOOR_SIDE in runs
    print(f"\nworkload {args.workload}, {args.repeats} repeat(s), medians; model {Path(model_dir).name} float32")
    head = f"{'':44} {'colocated':>10} {'disagg.':>10} {'ratio':>7}"
    if floor:
        head += f" {FLOOR_SIDE:>11} {'floor':>7}"
    print(head + ("\n" + " " * 76 + "(ratios to colocated)" if floor else ""))
    rows: list[tuple[str, str, str | None, str, int]] = [
        ("all", "output_throughput", None, "output tok/s", 1),
        ("all", "request_throughput", None, "req/s", 1),
    ]
    for cls in sorted(runs["colocated"][0]["by_class"]):
        for latency in ("tpot_s", "ttft_s", "itl_s"):
            for percentile in ("p50", "p99"):
                rows.append((cls, latency, percentile, f"{cls}: {latency[:-2]} {percentile}, ms", 1000))
    for section, metric, pct, label, scale in rows:
        a, b = med("colocated", section, metric, pct) * scale, med("disaggregated", section, metric, pct) * scale
        line = f"{label:44} {a:10.1f} {b:10.1f} {b / a if a else float('nan'):7.2f}"
        if floor and section == FLOOR_CLASS:  # the only class that side sends
            alone = med(FLOOR_SIDE, section, metric, pct) * scale
            line += f" {alone:11.1f} {alone / a if a else float('nan'):7.2f}"
        print(line)
    for side in sides:
        errors = [r["all"]["errors_by_status"] for r in runs[side] if r["all"]["errors_by_status"]]
        if errors:
            print(f"{side}: errors {errors}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
