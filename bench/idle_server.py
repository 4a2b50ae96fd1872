"""What an idle ``shapeserve serve`` costs the machine, and what it costs an engine computing beside it.

    python -m bench.idle_server [--pairs 2] [--idle-s 30] [--engine-pairs 2] \\
        [--a-rev REV] [--a-env KEY=VALUE ...] [--a-arg ARG ...] [--a-label NAME] \\
        [--b-rev REV] [--b-env KEY=VALUE ...] [--b-arg ARG ...] [--b-label NAME]

A served burst runs the engine on cores that Ray's and Serve's own processes also wake up on: the Serve
controller's loop, the proxy, the dashboard agent, the log monitor, GCS, the raylet and every core worker's
timers. On a 2-core machine where the engine's OpenMP threads take both cores, every such wake-up preempts one
of them, and the other waits for it at the next barrier. This bench puts a number on both halves of that:

1. Idle cost: a fresh server (its own local Ray, the bench model; sides as in ``bench.serve_ab``: a source tree,
   environment variables, extra arguments), one request to warm it up, 10 s to settle, then ``--idle-s`` seconds of
   no traffic: CPU milliseconds per second and context switches per second (wake-ups, roughly) by process group.
2. Beside the engine: with that server still up and idle, the offline engine (the bench model, 2 threads, prefix
   caching off, built once) runs the skewed-64 prompts ``--engine-pairs`` times beside it and as many times with
   the server frozen (SIGSTOP to every process of it: none runs, its memory stays), alternating which goes first.
   "beside / frozen" is the engine's output tok/s with the idle server running over the same without it.

Sides alternate over ``--pairs`` (A B, then B A); with no ``--a-rev/env/arg`` or ``--b-rev/env/arg`` there is one
side. Prints min / median
/ max per side, and the A/B ratio of the medians with two sides. Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import psutil

from bench.compare_servers import stop
from bench.engine_throughput import BENCH_SPEC, greedy, make_engine
from bench.serve_ab import Side, no_slo_admission_config, parse_env, source_tree, start, warm_up
from bench.server_process import ServerProcess, group_of, machine_line
from cluster.tools.demo_model import ensure_demo_model
from cluster.tools.workloads import load_workload

SETTLE_S = 10.0


def usage_by_group(server: ServerProcess) -> dict[int, tuple[str, float, int]]:
    """pid -> (group, CPU seconds, context switches) for every live process of the server's tree."""
    out = {}
    for p in server.tree():
        try:
            with p.oneshot():
                t, c = p.cpu_times(), p.num_ctx_switches()
                out[p.pid] = (group_of(p), t.user + t.system, c.voluntary + c.involuntary)
        except psutil.Error:
            continue
    return out


def idle_rates(server: ServerProcess, seconds: float) -> dict[str, tuple[float, float]]:
    """group -> (CPU ms per second, context switches per second) over ``seconds`` of no traffic; "all" sums them."""
    before = usage_by_group(server)
    time.sleep(seconds)
    after = usage_by_group(server)
    rates: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for pid, (group, cpu, switches) in after.items():
        _, cpu0, switches0 = before.get(pid, (group, 0.0, 0))
        for key in (group, "all"):
            rates[key][0] += (cpu - cpu0) / seconds * 1e3
            rates[key][1] += (switches - switches0) / seconds
    return {group: (cpu, switches) for group, (cpu, switches) in rates.items()}


@contextmanager
def frozen(server: ServerProcess):
    """Every process of the server stopped (SIGSTOP) for the block, continued after it."""
    procs = server.tree()
    for p in procs:
        try:
            p.send_signal(signal.SIGSTOP)
        except psutil.Error:
            pass
    try:
        yield
    finally:
        for p in procs:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.Error:
                pass


def engine_tok_s(engine, requests) -> float:
    """One pass of ``requests`` through the engine (prefix caching off: every pass computes the same work)."""
    start_t = time.perf_counter()
    for r in requests:
        engine.add_request(f"{r.index}-{start_t}", list(r.prompt_token_ids), greedy(r.output_tokens))
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start_t)


def side_from_args(args, side: str) -> Side:
    return Side(
        getattr(args, f"{side}_label"),
        source_tree(getattr(args, f"{side}_rev")),
        parse_env(getattr(args, f"{side}_env")),
        tuple(getattr(args, f"{side}_arg")),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=2, help="servers started per side (alternating order)")
    ap.add_argument("--idle-s", type=float, default=30.0, help="seconds of no traffic measured per server")
    ap.add_argument("--engine-pairs", type=int, default=2, help="engine passes beside each server, and as many frozen")
    ap.add_argument("--model-dir", default=".bench-models/llama-512h-8l")
    ap.add_argument("--port", type=int, default=8126)
    for name in ("a", "b"):
        ap.add_argument(f"--{name}-rev", default=None, help=f"git revision side {name.upper()} runs (default: here)")
        ap.add_argument(f"--{name}-env", action="append", default=[], metavar="KEY=VALUE")
        ap.add_argument(f"--{name}-arg", action="append", default=[], help="extra argument for shapeserve serve")
        ap.add_argument(f"--{name}-label", default=name.upper())
    ap.add_argument("--threads", type=int, default=2, help="the engine's threads")
    ap.add_argument("--kv-tokens", type=int, default=32768)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args(argv)

    model_dir = str(Path(ensure_demo_model(args.model_dir, BENCH_SPEC)).resolve())
    sides = [side_from_args(args, "a")]
    if any(getattr(args, f"{name}_{what}") for name in "ab" for what in ("rev", "env", "arg")):
        sides.append(side_from_args(args, "b"))
        if sides[0].label == sides[1].label:
            raise SystemExit("--a-label and --b-label must differ")
    config = no_slo_admission_config()
    _, requests = load_workload("skewed-64", BENCH_SPEC.vocab_size)
    print(f"machine: {machine_line()}")
    for s in sides:
        print(f"side {s.label}: tree {s.tree}, env {s.env or '-'}, args {' '.join(s.args) or '-'}")
    print("building the engine (bench model, prefix caching off)", flush=True)
    engine = make_engine(Path(model_dir), args, requests, prefix_caching=False)

    idle: dict[str, list[dict[str, tuple[float, float]]]] = {s.label: [] for s in sides}
    ratios: dict[str, list[float]] = {s.label: [] for s in sides}
    started = time.monotonic()
    for pair in range(args.pairs):
        for side in reversed(sides) if pair % 2 else sides:
            server = start(side, model_dir, args.port, config)
            try:
                warm_up(server.url, Path(model_dir).name)
                time.sleep(SETTLE_S)
                rates = idle_rates(server, args.idle_s)
                idle[side.label].append(rates)
                cpu, switches = rates["all"]
                print(f"  {side.label}: idle {cpu:.0f} CPU ms/s, {switches:.0f} switches/s", flush=True)
                for k in range(args.engine_pairs):
                    runs = {}
                    for mode in ("frozen", "beside") if (pair + k) % 2 else ("beside", "frozen"):
                        if mode == "frozen":
                            with frozen(server):
                                runs[mode] = engine_tok_s(engine, requests)
                        else:
                            runs[mode] = engine_tok_s(engine, requests)
                    ratios[side.label].append(runs["beside"] / runs["frozen"])
                    print(
                        f"  {side.label}: engine {runs['beside']:.0f} tok/s beside, {runs['frozen']:.0f} frozen "
                        f"({ratios[side.label][-1]:.3f})",
                        flush=True,
                    )
            finally:
                stop(server, args.port)
    report(sides, idle, ratios)
    print(f"\n{time.monotonic() - started:.0f} s in all; engine pid {os.getpid()}, {args.threads} threads")


def report(sides: list[Side], idle: dict, ratios: dict[str, list[float]]) -> None:
    def mmm(values: list[float], fmt: str = "{:.1f}") -> str:
        return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))

    groups = sorted({g for runs in idle.values() for rates in runs for g in rates if g != "all"})
    for s in sides:
        runs = idle[s.label]
        print(f"\nside {s.label}: idle server, min / median / max over {len(runs)} servers")
        print(f"  {'process group':<34} {'CPU ms/s':>22} {'switches/s':>22}")
        for g in [*groups, "all"]:
            cpu = [r.get(g, (0.0, 0.0))[0] for r in runs]
            sw = [r.get(g, (0.0, 0.0))[1] for r in runs]
            print(f"  {g:<34} {mmm(cpu):>22} {mmm(sw, '{:.0f}'):>22}")
        print(f"  engine beside the idle server / frozen: {mmm(ratios[s.label], '{:.3f}')}")
    if len(sides) == 2:
        a, b = (s.label for s in sides)

        def med(label: str, i: int) -> float:
            return statistics.median(r["all"][i] for r in idle[label])

        print(
            f"\n{a} / {b} (medians): idle CPU {med(a, 0) / med(b, 0):.2f}x, switches {med(a, 1) / med(b, 1):.2f}x, "
            f"engine beside / frozen {statistics.median(ratios[a]) / statistics.median(ratios[b]):.3f}x"
        )


if __name__ == "__main__":
    main()
