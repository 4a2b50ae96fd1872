"""A ramp-and-drop load against fixed-size decode pools and the autoscaled one, on a multi-node local Ray cluster.

    python -m bench.autoscale_ramp [--repeats 1] [--low-rate 1] [--high-rate 8]

One cluster (a head node and two nodes with a ``decode`` resource, so the pool can have two replicas on nodes of
their own), the demo model, and three deployments of the same app one after another: the decode pool fixed at 1
replica, fixed at 2 (its maximum), and autoscaled between 1 and 2 by ``DecodeAutoscalingPolicy``. Each gets the
same requests: Poisson arrivals at ``--low-rate`` for a while, ``--high-rate`` for twice as long, then
``--low-rate`` again (64-token prompts, 64 output tokens, each prompt new to the prefix cache). Prints TTFT and
TPOT p99, goodput under the SLO, and replica-seconds (running decode replicas integrated over the run, polled
from Serve every 0.5 s), with ratios against the fixed pool at its maximum measured in the same run.

All nodes share this machine's cores: what autoscaling can show here is replica-seconds saved for the latency it
keeps, not extra compute from a new node.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import sys
import threading
import time
from typing import Any

from bench.server_process import machine_line
from cluster.tools.demo_model import ensure_demo_model
from cluster.tools.loadgen import run_load, summarize
from cluster.tools.workloads import WorkloadRequest

SLO = {"ttft_ms": 1000, "tpot_ms": 100}
PROMPT_TOKENS = OUTPUT_TOKENS = 64


def ramp_and_drop(low: float, high: float, phase_s: float, vocab: int, seed: int) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    requests: list[WorkloadRequest] = []
    t, phases = 0.0, [(low, phase_s), (high, 2 * phase_s), (low, phase_s)]
    end = 0.0
    for rate, length in phases:
        end += length
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                t = end
                break
            prompt = tuple(rng.randrange(4, vocab) for _ in range(PROMPT_TOKENS))
            requests.append(WorkloadRequest(len(requests), "chat", t, prompt, OUTPUT_TOKENS))
    return requests


def config(port: int, decode: dict[str, Any]) -> Any:
    from cluster.serving.config import parse_serve_config

    return parse_serve_config(
        {
            "device": "cpu",
            "host": "127.0.0.1",
            "port": port,
            "served_model_name": "demo",
            "disaggregation": "off",
            "decode": {"num_cpus": 0, "num_threads": 1, "num_blocks": 512, "resources": {"decode": 1}, **decode},
            "slo": SLO,
        }
    )


POLICY = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_running_seqs_per_replica": 4,
    "upscale_delay_s": 1,
    "downscale_delay_s": 5,
    "spike_window_s": 2,
    "metrics_push_interval_s": 0.5,
}
SIDES: dict[str, dict[str, Any]] = {
    "fixed 1": {"num_replicas": 1},
    "fixed 2": {"num_replicas": 2},
    "autoscaled 1-2": {"autoscaling": POLICY},
}


def running_decode_replicas() -> int:
    from ray import serve

    from cluster.app import APP_NAME

    states: dict[Any, int] = dict(serve.status().applications[APP_NAME].deployments["DecodeWorker"].replica_states)
    return states.get("RUNNING", 0)


def one_side(model_dir: str, port: int, decode: dict[str, Any], requests: list[WorkloadRequest]) -> dict[str, Any]:
    import httpx
    from ray import serve

    from cluster.app import APP_NAME, build_app

    serve.run(build_app(config(port, decode), model_dir), name=APP_NAME, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 120
    while httpx.get(f"{url}/health", timeout=5).status_code != 200:
        if time.monotonic() > end:
            raise TimeoutError("the decode pool did not become healthy")
        time.sleep(0.5)
    samples: list[int] = []
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.5):
            samples.append(running_decode_replicas())

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        records, duration = asyncio.run(run_load(f"{url}/v1", "demo", requests, timeout_s=300, progress=False))
    finally:
        done.set()
        poller.join()
    serve.delete(APP_NAME)
    summary = summarize(records, duration, SLO)
    return {
        "ttft_p99_ms": summary["ttft_s"]["p99"] * 1000,
        "tpot_p99_ms": summary["tpot_s"]["p99"] * 1000,
        "goodput": summary["goodput"],
        "failed": summary["failed"],
        "replica_seconds": 0.5 * sum(samples),
        "max_replicas_seen": max(samples, default=0),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--low-rate", type=float, default=1.0)
    ap.add_argument("--high-rate", type=float, default=8.0)
    ap.add_argument("--phase-s", type=float, default=15.0, help="length of each low phase (the high one is twice)")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    model_dir = str(ensure_demo_model())
    print(machine_line())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"decode": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for repeat in range(args.repeats):
            requests = ramp_and_drop(args.low_rate, args.high_rate, args.phase_s, 512, seed=1000 + repeat)
            print(f"repeat {repeat + 1}: {len(requests)} requests over {4 * args.phase_s:.0f} s", flush=True)
            for side, decode in SIDES.items():
                result = one_side(model_dir, port, decode, requests)
                runs[side].append(result)
                print(f"  {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items()), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    base = "fixed 2"
    print(f"\nmedian over {args.repeats} repeat(s) (min-max); ratio to '{base}' in the same run")
    for metric in ("ttft_p99_ms", "tpot_p99_ms", "goodput", "replica_seconds", "failed"):
        base_median = statistics.median(r[metric] for r in runs[base])
        cells = []
        for side in SIDES:
            values = [r[metric] for r in runs[side]]
            ratio = f" x{statistics.median(values) / base_median:.2f}" if base_median else ""
            cells.append(f"{side} {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}){ratio}")
        print(f"{metric:16} " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
