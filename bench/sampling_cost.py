"""What logit_bias, min_tokens, min_p, the penalties and logprobs cost the engine, against the engine without
them, in one run.

    python -m bench.sampling_cost [--repeats 3] [--requests 32] [--output-tokens 64]

Offline engine on the bench model (hidden 512, 8 layers, vocab 32000, float32), ``--requests`` prompts of 64
tokens, ``--output-tokens`` each, prefix caching off so every run does the same work. Variants, run round-robin
in each repeat so they share the machine's noise:

- ``baseline``: the sampler with the logits processors bypassed (the engine as it was without them);
- ``off``: the engine as shipped, no request using any of them (target: >= 0.98 x baseline);
- one variant per feature, every request using it; sampled variants are compared with ``sampled``, the same
  temperature and seed without the feature. Variants run in a new random order each repeat.

Prints output tokens/s and each variant's ratio to its baseline, min / median / max over ``--repeats``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import replace

from bench.engine_throughput import BENCH_SPEC
from bench.server_process import machine_line
from cluster.config import CacheConfig, EngineConfig, SamplingParams
from cluster.engine import sampler
from cluster.tools.demo_model import ensure_demo_model


@contextmanager
def processors_bypassed():
    real = sampler.process_logits
    sampler.process_logits = lambda logits, *_: logits
    try:
        yield
    finally:
        sampler.process_logits = real


def variants(output_tokens: int) -> dict[str, tuple[str, SamplingParams]]:
    """name -> (the variant it is compared with, params of every request)."""
    greedy = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    sampled = replace(greedy, temperature=1.0, seed=1)
    return {
        "baseline": ("baseline", greedy),
        "off": ("baseline", greedy),
        "presence+frequency": ("baseline", replace(greedy, presence_penalty=0.5, frequency_penalty=0.5)),
        "repetition": ("baseline", replace(greedy, repetition_penalty=1.2)),
        "logit_bias (16 tokens)": ("baseline", replace(greedy, logit_bias=tuple((t, -5.0) for t in range(16)))),
        "min_tokens (= max_tokens)": ("baseline", replace(greedy, min_tokens=output_tokens, ignore_eos=False)),
        "logprobs": ("baseline", replace(greedy, logprobs=True)),
        "logprobs + top_logprobs 5": ("baseline", replace(greedy, logprobs=True, top_logprobs=5)),
        "sampled": ("sampled", sampled),
        "sampled + min_p 0.1": ("sampled", replace(sampled, min_p=0.1)),
    }


def tokens_per_s(engine, prompts: list[list[int]], params: SamplingParams, bypass: bool) -> float:
    t0 = time.perf_counter()
    if bypass:
        with processors_bypassed():
            outs = engine.generate(prompts, params)
    else:
        outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return sum(len(o["token_ids"]) for o in outs) / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--model-dir", default=".bench-models/llama-512h-8l")
    args = ap.parse_args()
    from cluster.engine.llm_engine import LLMEngine

    model_dir = str(ensure_demo_model(args.model_dir, BENCH_SPEC))
    print(machine_line())
    engine = LLMEngine(EngineConfig(model=model_dir, cache=CacheConfig(num_blocks=2048, enable_prefix_caching=False)))
    rng = random.Random(0)
    prompts = [[rng.randrange(4, BENCH_SPEC.vocab_size) for _ in range(64)] for _ in range(args.requests)]
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm up
    table = variants(args.output_tokens)
    rates: dict[str, list[float]] = {name: [] for name in table}
    for r in range(args.repeats):
        # A new order each repeat: a variant that always ran first (or after the slowest) would carry that bias.
        order = list(table)
        random.Random(r).shuffle(order)
        for name in order:
            rates[name].append(tokens_per_s(engine, prompts, table[name][1], bypass=name == "baseline"))
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)
    print(f"\n{args.requests} requests x {args.output_tokens} output tokens, {args.repeats} repeats")
    print(f"{'variant':28} {'tok/s median':>12} {'ratio min':>10} {'median':>8} {'max':>8}  (vs)")
    for name, (base, _) in table.items():
        ratios = [v / b for v, b in zip(rates[name], rates[base], strict=True)]
        print(
            f"{name:28} {statistics.median(rates[name]):12.1f} {min(ratios):10.3f} {statistics.median(ratios):8.3f} "
            f"{max(ratios):8.3f}  ({base})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
