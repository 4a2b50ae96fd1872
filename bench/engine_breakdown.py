"""Where the engine's time goes on a workload: per step phase and per part of a step.

    python -m bench.engine_breakdown [--workload skewed-64] [--threads 2]

Runs the same engine as ``bench.engine_throughput`` (same model, same arguments) once, with
timers wrapped around the matmuls, attention, KV writes, sampling, the scheduler and the
postprocessing, and prints seconds per part and for steps with and without prefill tokens.
The timers cost a little themselves: take throughput from ``bench.engine_throughput``.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

import cluster.engine.model_runner as runner_module
from bench.engine_throughput import BENCH_SPEC, add_engine_args, greedy, make_engine
from cluster.engine.linear import use_matmul
from cluster.tools.demo_model import ensure_demo_model
from cluster.tools.workloads import load_workload


class StepTimers:
    """Wraps engine functions in timers; ``restore()`` puts the originals back."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._saved: list[tuple[object, str, object]] = []

    def timed(self, fn, label):
        """``fn`` with its time added to the bucket ``label(*args)`` names."""

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label(*args)] += time.perf_counter() - start

        return timed

    def wrap(self, owner, name: str, label) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, self.timed(original, label))

    def restore(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = ensure_demo_model(args.model_dir, BENCH_SPEC)
    spec, requests = load_workload(args.workload, BENCH_SPEC.vocab_size)
    engine = make_engine(model_dir, args, requests)

    timers = StepTimers()
    # The model's Linear layers run the matmul the engine chose for them at start.
    use_matmul(
        engine.model, timers.timed(engine.matmul.fn, lambda x, weight, *_: f"matmul, {weight.shape[0]} out features")
    )
    timers.wrap(engine.backend, "attend", lambda *_: "attention")
    timers.wrap(engine.backend, "write_kv", lambda *_: "KV cache write")
    timers.wrap(runner_module, "sample", lambda *_: "sampling")
    timers.wrap(engine.runner, "prepare", lambda *_: "batch preparation (numpy)")
    timers.wrap(engine, "_postprocess", lambda *_: "postprocess (detokenize, stop checks)")
    scheduled = []
    schedule = engine.scheduler.schedule

    def schedule_and_remember():
        start = time.perf_counter()
        out = schedule()
        timers.seconds["scheduler"] += time.perf_counter() - start
        scheduled.append(out)
        return out

    engine.scheduler.schedule = schedule_and_remember  # type: ignore[method-assign]
    phases = {"steps with prefill tokens": [0, 0.0, 0], "decode-only steps": [0, 0.0, 0]}
    try:
        for r in requests:
            engine.add_request(str(r.index), list(r.prompt_token_ids), greedy(r.output_tokens))
        total_start = time.perf_counter()
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            out = scheduled.pop()
            decode_only = all(s.num_tokens == 1 for s in out.scheduled)
            phase = phases["decode-only steps" if decode_only else "steps with prefill tokens"]
            phase[0] += 1
            phase[1] += time.perf_counter() - start
            phase[2] += out.num_tokens
        total = time.perf_counter() - total_start
    finally:
        timers.restore()
        use_matmul(engine.model, engine.matmul.fn)
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]

    print(f"workload {spec['name']}, torch threads {args.threads}: {total:.2f} s in all (with timers)")
    print(f"\n{'phase':<40} {'steps':>6} {'seconds':>8} {'tokens':>8} {'ms/step':>8}")
    for name, (steps, secs, tokens) in phases.items():
        print(f"{name:<40} {steps:6d} {secs:8.2f} {tokens:8d} {secs / max(steps, 1) * 1e3:8.1f}")
    print(f"\n{'part':<40} {'seconds':>8} {'share':>6}")
    for key, secs in sorted(timers.seconds.items(), key=lambda kv: -kv[1]):
        print(f"{key:<40} {secs:8.2f} {secs / total:6.1%}")
    rest = total - sum(timers.seconds.values())
    print(f"{'rest (norms, rotary, MLP activation, ...)':<40} {rest:8.2f} {rest / total:6.1%}")


if __name__ == "__main__":
    main()
