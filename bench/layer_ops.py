"""The compiled layer kernels (``cluster/engine/cpu_layer_kernels.py``) against torch's element-wise ops.

    python -m bench.layer_ops [--repeats 3] [--batches 1,8,32,64] [--context 256]

One engine (the ``bench.engine_throughput`` model and arguments), its layers switched between the
two ``LayerOps`` in turn, A then B within every repeat, so both see the same machine:

- decode step time at each batch size (every sequence ``--context`` tokens in), median of 20 steps;
- one prefill step of ``--max-num-batched-tokens`` prompt tokens;
- the whole ``--workload`` (skewed-64: 64 requests at once), output tokens/s.

Prints min/median/max over the repeats and the compiled/torch ratio of the medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench.ab import alternate, print_ab_table
from bench.engine_throughput import BENCH_SPEC, add_engine_args, greedy, make_engine
from cluster.engine.layer_ops import TORCH_LAYER_OPS
from cluster.engine.llm_engine import LLMEngine
from cluster.tools.demo_model import ensure_demo_model
from cluster.tools.workloads import load_workload

_ids = iter(range(10**9))


def _prompts(rng: random.Random, count: int, length: int) -> list[list[int]]:
    return [[rng.randrange(4, BENCH_SPEC.vocab_size) for _ in range(length)] for _ in range(count)]


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def decode_step_ms(engine: LLMEngine, rng: random.Random, batch: int, context: int, steps: int = 20) -> float:
    for prompt in _prompts(rng, batch, context):
        engine.add_request(f"d{next(_ids)}", prompt, greedy(steps + 4))
    # Prefill every prompt (and take one decode step) before timing.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    _drain(engine)
    return statistics.median(times) * 1e3


def prefill_step_ms(engine: LLMEngine, rng: random.Random, tokens: int, context: int) -> float:
    for prompt in _prompts(rng, max(1, tokens // context), context):
        engine.add_request(f"p{next(_ids)}", prompt, greedy(1))
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    _drain(engine)
    return elapsed * 1e3


def workload_tok_s(engine: LLMEngine, requests) -> float:
    for r in requests:
        engine.add_request(f"w{next(_ids)}-{r.index}", list(r.prompt_token_ids), greedy(r.output_tokens))
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = ensure_demo_model(args.model_dir, BENCH_SPEC)
    _, requests = load_workload(args.workload, BENCH_SPEC.vocab_size)
    engine = make_engine(model_dir, args, requests, prefix_caching=False)
    compiled = engine.model.layer_ops
    if compiled.name != "compiled":
        raise SystemExit(f"the compiled layer kernels are unavailable here: {compiled.fallback_reason}")
    sides = {"compiled": compiled, "torch": TORCH_LAYER_OPS}
    batches = [int(b) for b in args.batches.split(",")]
    rows = [f"decode step, batch {b}, ms" for b in batches]
    rows += [f"prefill step, {args.max_num_batched_tokens} tokens, ms", f"{args.workload}, output tok/s"]
    print(f"threads {args.threads}; context {args.context}; {args.repeats} repeats, compiled then torch in each")

    def use(side: str) -> None:
        engine.model.layer_ops = sides[side]

    def measure(rng: random.Random) -> list[float]:
        got = [decode_step_ms(engine, rng, b, args.context) for b in batches]
        got.append(prefill_step_ms(engine, rng, args.max_num_batched_tokens, args.context))
        return [*got, workload_tok_s(engine, requests)]

    workload_tok_s(engine, requests)  # untimed: the first run pays page faults that would land on one side
    results = alternate(list(sides), use, measure, rows, args.repeats)
    print_ab_table(results, rows, "compiled", "torch")


if __name__ == "__main__":
    main()
