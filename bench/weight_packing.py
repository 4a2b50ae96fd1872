"""Engine step time with the linear weights in oneDNN's blocked layout (what engines do on CPU) vs as loaded.

    python -m bench.weight_packing [--batches 1 16 64] [--repeats 5] [--steps 20] [--threads 2]

Two engines on the bench model (hidden 512, 8 layers, vocab 32000, float32) in one process, the same
requests; the baseline keeps oneDNN but on unpacked weights (oneDNN then reorders each weight on every
call). For each decode batch size, the engines alternate rounds of ``--steps`` decode steps; the figure is
a round's median step time, reported as min/median/max over ``--repeats`` rounds, with the ratio
plain/packed (>1: packing is faster). A 512-token prefill step is timed the same way.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.engine_throughput import BENCH_SPEC
from cluster.config import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig
from cluster.engine import linear
from cluster.engine.llm_engine import LLMEngine
from cluster.tools.demo_model import ensure_demo_model

PROMPT_TOKENS = 128


def build_engine(model_dir: Path, threads: int, packed: bool) -> LLMEngine:
    config = EngineConfig(
        model=str(model_dir),
        num_threads=threads,
        cache=CacheConfig(block_size=16, num_blocks=2048),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256),
    )
    if packed:
        engine = LLMEngine(config)
    else:
        original = linear.onednn_pack

        def refuse(weight: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("baseline: weights as loaded")

        linear.onednn_pack = refuse  # choose_matmul then keeps oneDNN on plain weights
        try:
            engine = LLMEngine(config)
        finally:
            linear.onednn_pack = original
    assert (engine.matmul.pack is not None) == packed, engine.matmul
    return engine


def fill(engine: LLMEngine, batch: int, prompt_tokens: int, max_tokens: int, seed: int) -> None:
    """Adds ``batch`` greedy requests and runs them until every prompt is in the KV cache."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"s{seed}-{i}", [rng.randrange(4, vocab) for _ in range(prompt_tokens)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()


def drain(engine: LLMEngine) -> None:
    for rid in list(engine.requests):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def median_step_s(engine: LLMEngine, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timed_prefill_s(engine: LLMEngine, tokens: int, seed: int) -> float:
    t = time.perf_counter()
    fill(engine, 1, tokens, 1, seed)
    elapsed = time.perf_counter() - t
    drain(engine)
    return elapsed


def summary(xs: list[float]) -> str:
    return f"{min(xs) * 1e3:7.1f} / {statistics.median(xs) * 1e3:7.1f} / {max(xs) * 1e3:7.1f}"


def compare(label: str, rounds: int, measure: Callable[[str, int], float]) -> None:
    """Alternates the two engines ``rounds`` times (order flipped every round) and prints min/median/max."""
    results: dict[str, list[float]] = {"plain": [], "packed": []}
    for r in range(rounds):
        for name in ("plain", "packed") if r % 2 == 0 else ("packed", "plain"):
            results[name].append(measure(name, r))
    ratio = statistics.median(results["plain"]) / statistics.median(results["packed"])
    print(
        f"{label:<22} {summary(results['plain'])}   {summary(results['packed'])}   {ratio:5.2f}x",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="decode steps per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=Path(".bench-models/llama-512h-8l"))
    args = parser.parse_args()

    model_dir = ensure_demo_model(args.model_dir, BENCH_SPEC)
    engines = {name: build_engine(model_dir, args.threads, packed=name == "packed") for name in ("plain", "packed")}
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{args.threads} threads; step time ms, min / median / max over {args.repeats} rounds"
    )
    print(f"{'':<22} {'plain (baseline)':^25}   {'packed':^25}   plain/packed")
    for engine in engines.values():  # warm-up: first-call allocations and kernel choices
        fill(engine, 2, PROMPT_TOKENS, 4, seed=99)
        drain(engine)
    for batch in args.batches:
        steps_needed = args.steps * args.repeats + 1
        for seed, engine in enumerate(engines.values()):
            fill(engine, batch, PROMPT_TOKENS, steps_needed + 1, seed=batch * 10 + seed)
        compare(f"decode, batch {batch}", args.repeats, lambda name, r: median_step_s(engines[name], args.steps))
        for engine in engines.values():
            drain(engine)
    compare("prefill, 512 tokens", args.repeats, lambda name, r: timed_prefill_s(engines[name], 512, seed=1000 + r))


if __name__ == "__main__":
    main()
