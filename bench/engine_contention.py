"""What Python work beside the engine costs its steps, by where that work runs.

    python -m bench.engine_contention [--workload skewed-64] [--rate 2] [--work-us 250] [--repeats 3]

(Against an older engine, from the repository root: ``PYTHONPATH=<a worktree of it> .venv/bin/python
bench/engine_contention.py --workload ../shared/workloads/skewed-64.json``; the worktree's own imports come
first, and its tree has no ../shared beside it, hence the workload's path.)

A decode replica runs the engine on a thread and streams its outputs from the event loop of the same
process: both need the GIL, and on a small machine both need the cores the engine's OpenMP threads
compute on. This bench isolates that: one engine (the bench model, float32, prefix caching off so every run
computes the same work) serves skewed-64 with Poisson arrivals at ``--rate``, and after every step a
consumer spends ``--work-us`` of pure-Python time per output token (``python -m bench.replica_threads``
measures what a replica's event loop spends: "rest of the replica, ms per output token"). The consumer runs

- ``none``: nowhere (the engine alone);
- ``thread``: on a thread of the engine's process, with the replica's GIL switch interval (how a decode
  replica streams today);
- ``process``: in a process of its own, fed through a pipe (how vLLM's API server sits beside its engine core).

Modes alternate within every repeat (the order reversed every other repeat), each repeat on new prompts.
Prints the engine's mean step wall time, mean TPOT, median TTFT and mean batch per mode, min / median / max
over the repeats, and each mode's ratio to ``none``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODES = ("none", "thread", "process")


def _spend(seconds: float) -> None:
    """Pure-Python work that holds the GIL the way an event loop encoding and writing chunks does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _consume_pipe(conn: Connection, work_s: float) -> None:  # the process mode's consumer (a spawned process)
    while (tokens := conn.recv()) is not None:
        _spend(work_s * tokens)


class _Consumer:
    """Receives each step's output-token count and spends ``work_s`` per token, where ``mode`` says."""

    def __init__(self, mode: str, work_s: float):
        self.mode = mode
        self._thread: threading.Thread | None = None
        self._process = None
        if mode == "thread":
            self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()

            def run() -> None:
                while (tokens := self._queue.get()) is not None:
                    _spend(work_s * tokens)

            self._thread = threading.Thread(target=run, daemon=True)
            self._thread.start()
        elif mode == "process":
            ours, theirs = multiprocessing.get_context("spawn").Pipe()
            self._conn = ours
            self._process = multiprocessing.get_context("spawn").Process(
                target=_consume_pipe, args=(theirs, work_s), daemon=True
            )
            self._process.start()

    def feed(self, tokens: int) -> None:
        if self.mode == "thread":
            self._queue.put(tokens)
        elif self.mode == "process":
            self._conn.send(tokens)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        if self._process is not None:
            self._conn.send(None)
            self._process.join()


def run_stream(engine, workload: str, rate: float, seed: int, after_step: Callable[[int], None]) -> dict[str, float]:
    """``workload`` at ``rate`` through ``engine``, each request added once its arrival time has passed;
    ``after_step(tokens)`` after every step. Returns the engine's mean step wall time, mean TPOT, median TTFT
    and mean batch (requests given a token per step). A loop of its own rather than
    ``bench.compare_engines.poisson_run``: run against an older revision's tree, this file imports that tree's
    modules, whose driver loop may differ."""
    from bench.engine_throughput import BENCH_SPEC, greedy
    from cluster.tools.workloads import load_workload

    _, requests = load_workload(workload, BENCH_SPEC.vocab_size, rate_per_s=rate, seed=seed)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    produced: dict[str, int] = {}
    steps: list[float] = []
    batch: list[int] = []
    start = time.perf_counter()
    i = 0
    while i < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while i < len(requests) and requests[i].arrival_s <= now:
            r = requests[i]
            engine.add_request(f"s{seed}-{r.index}", list(r.prompt_token_ids), greedy(r.output_tokens))
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[i].arrival_s - now))
            continue
        step_start = time.perf_counter()
        outputs = engine.step()
        t = time.perf_counter()
        steps.append(t - step_start)
        tokens = 0
        for o in outputs:
            if o.new_token_ids:
                rid = o.request_id
                first.setdefault(rid, t - start)
                last[rid] = t - start
                produced[rid] = produced.get(rid, 0) + len(o.new_token_ids)
                tokens += len(o.new_token_ids)
        batch.append(tokens)
        after_step(tokens)
    tpot = [(last[r] - first[r]) / (produced[r] - 1) for r in first if produced[r] > 1]
    ttft = [first[f"s{seed}-{r.index}"] - r.arrival_s for r in requests]
    return {
        "mean step wall, ms": statistics.mean(steps) * 1e3,
        "mean TPOT, ms": statistics.mean(tpot) * 1e3,
        "median TTFT, ms": statistics.median(ttft) * 1e3,
        "mean batch (tokens per step)": statistics.mean(batch),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="skewed-64", help="a workload's name or file")
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--work-us", type=float, default=250.0, help="consumer's pure-Python time per output token")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the cores this process has)")
    args = ap.parse_args(argv)

    import os

    import torch

    from bench.engine_throughput import BENCH_SPEC, make_engine
    from bench.server_process import machine_line
    from cluster.serving.async_engine import GIL_SWITCH_INTERVAL_S
    from cluster.tools.demo_model import ensure_demo_model
    from cluster.tools.workloads import load_workload

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)

    class EngineArgs:
        kv_tokens = 65536
        max_num_batched_tokens = 2048

    EngineArgs.threads = threads  # type: ignore[attr-defined]
    model_dir = ensure_demo_model(REPO / ".bench-models/llama-512h-8l", BENCH_SPEC)
    _, warm = load_workload(args.workload, BENCH_SPEC.vocab_size, num_requests=2)
    engine = make_engine(model_dir, EngineArgs, warm, prefix_caching=False)
    print(machine_line(), flush=True)
    print(f"{args.workload} at {args.rate:g} req/s, {args.work_us:g} us of Python per output token", end="")
    print(f", torch threads {threads}")

    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for repeat in range(args.repeats):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            consumer = _Consumer(mode, args.work_us * 1e-6)
            # The replica's interval where the consumer shares the process; CPython's default elsewhere.
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S if mode == "thread" else 0.005)
            try:
                run = run_stream(engine, args.workload, args.rate, seed=1000 + repeat, after_step=consumer.feed)
            finally:
                consumer.close()
            results[mode].append(run)
            print(f"  repeat {repeat + 1}/{args.repeats} {mode}: " + ", ".join(f"{k} {v:.1f}" for k, v in run.items()))
    print(f"\n{'':<32}" + "".join(f" {m + ' min/med/max':>23}" for m in MODES) + "   thread/none  process/none")
    for key in results["none"][0]:
        values = {m: [r[key] for r in results[m]] for m in MODES}
        med = {m: statistics.median(v) for m, v in values.items()}
        cells = "".join(f" {min(v):7.1f}{med[m]:8.1f}{max(v):8.1f}" for m, v in values.items())
        print(f"{key:<32}{cells}   {med['thread'] / med['none']:10.2f}x {med['process'] / med['none']:12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
