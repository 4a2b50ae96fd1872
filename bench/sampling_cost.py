"""What logit_bias, min_tokens, min_p, the penalties, logprobs and grammars cost the engine, against the engine without
them, in one run.

    python -m bench.sampling_cost [--repeats 3] [--requests 32] [--output-tokens 64] [--sampler-only]

Offline engine on the bench model (hidden 512, 8 layers, vocab 32000, float32), ``--requests`` prompts of 64
tokens, ``--output-tokens`` each, prefix caching off so every run does the same work. Variants, run round-robin
in each repeat so they share the machine's noise:

- ``baseline``: the sampler with the logits processors bypassed (the engine as it was without them);
- ``off``: the engine as shipped, no request using any of them (target: >= 0.98 x baseline);
- one variant per feature, every request using it; sampled variants are compared with ``sampled``, the same
  temperature and seed without the feature;
- the sampler against the one it replaced (an exponential race, one random number per vocabulary entry, and a
  full sort for top-k / top-p), kept in this file as ``exponential_race``: plain sampling and top_k 50.

Variants run in a new random order each repeat. First, the sampler alone (no model): the wall time of one
sampling pass over a [32, 32000] batch of random logits, previous sampler against the current one, for plain,
seeded, top_k 50 and top_p 0.9 rows (random logits are flat: top_p takes the full-sort fallback);
``--sampler-only`` stops there.

Prints output tokens/s and each variant's ratio to its baseline, min / median / max over ``--repeats``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

from bench.engine_throughput import BENCH_SPEC
from bench.server_process import machine_line
from cluster.config import CacheConfig, EngineConfig, SamplingParams, StructuredOutput
from cluster.engine import sampler
from cluster.tools.demo_model import ensure_demo_model


def exponential_race(logits, params, generators, greedy):
    """The sampler this engine had before the inverse-CDF one (kept here as the baseline it is measured against):
    temperature, min_p, top-k / top-p on a full sort, then argmax(p / q) with q ~ Exp(1) drawn per vocabulary
    entry (and again from a seeded request's own generator)."""
    import torch

    vocab = logits.shape[1]
    temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)])
    scaled = logits / temps[:, None]
    if any(p.min_p > 0.0 for p in params):
        log_min_p = torch.tensor([p.min_p for p in params]).log()
        scaled = scaled.masked_fill(scaled < scaled.amax(dim=-1, keepdim=True) + log_min_p[:, None], float("-inf"))
    top_ks = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params])
    top_ps = torch.tensor([p.top_p for p in params])
    if (top_ks < vocab).any() or (top_ps < 1.0).any():
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        drop = torch.arange(vocab)[None, :] >= top_ks[:, None]
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        drop |= (probs.cumsum(dim=-1) - probs) >= top_ps[:, None]
        drop[:, 0] = False
        scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None and not greedy[i]:
            noise[i].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(torch.tensor(greedy), logits.argmax(dim=-1), sampled)


@contextmanager
def patched(kind: str | None):
    """``bypass``: the logits processors skipped (the engine without them); ``race``: the previous sampler."""
    real_process, real_random = sampler.process_logits, sampler._sample_random
    if kind == "bypass":
        sampler.process_logits = lambda logits, *_: logits
    elif kind == "race":
        sampler._sample_random = exponential_race
    try:
        yield
    finally:
        sampler.process_logits, sampler._sample_random = real_process, real_random


def variants(output_tokens: int) -> dict[str, tuple[str, SamplingParams, str | None]]:
    """name -> (the variant it is compared with, params of every request, what is patched for it)."""
    greedy = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    sampled = replace(greedy, temperature=1.0, seed=1)
    return {
        "baseline": ("baseline", greedy, "bypass"),
        "off": ("baseline", greedy, None),
        "presence+frequency": ("baseline", replace(greedy, presence_penalty=0.5, frequency_penalty=0.5), None),
        "repetition": ("baseline", replace(greedy, repetition_penalty=1.2), None),
        "logit_bias (16 tokens)": ("baseline", replace(greedy, logit_bias=tuple((t, -5.0) for t in range(16))), None),
        "min_tokens (= max_tokens)": ("baseline", replace(greedy, min_tokens=output_tokens, ignore_eos=False), None),
        "logprobs": ("baseline", replace(greedy, logprobs=True), None),
        "logprobs + top_logprobs 5": ("baseline", replace(greedy, logprobs=True, top_logprobs=5), None),
        # A pattern longer than max_tokens: every step of every request runs under the grammar mask.
        "grammar (regex mask)": (
            "baseline",
            replace(greedy, structured=StructuredOutput("regex", "[a-z ]{2000}")),
            None,
        ),
        "sampled": ("sampled", sampled, None),
        "sampled + min_p 0.1": ("sampled", replace(sampled, min_p=0.1), None),
        "sampled, previous sampler": ("sampled, previous sampler", sampled, "race"),
        "sampled vs previous": ("sampled, previous sampler", sampled, None),
        "top_k 50, previous sampler": ("top_k 50, previous sampler", replace(sampled, top_k=50), "race"),
        "top_k 50 vs previous": ("top_k 50, previous sampler", replace(sampled, top_k=50), None),
    }


def tokens_per_s(engine, prompts: list[list[int]], params: SamplingParams, patch: str | None) -> float:
    t0 = time.perf_counter()
    with patched(patch):
        outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return sum(len(o["token_ids"]) for o in outs) / elapsed


def off_path_us_per_step(batch: int, vocab: int, repeats: int = 2000) -> float:
    """CPU time of what every step now runs when no request asks for any feature: the logits processors' check,
    the grammar check and the sampler's logprob / alternative bookkeeping, on a batch of plain greedy requests."""
    import torch

    logits = torch.randn(batch, vocab)
    params = [SamplingParams(temperature=0.0)] * batch
    histories = [_History([1, 2, 3], [4]) for _ in range(batch)]
    matchers = [None] * batch
    t0 = time.process_time()
    for _ in range(repeats):
        sampler.process_logits(logits, params, histories, (2,))
        any(m is not None for m in matchers)  # the sampler's structured-output check
        [i for i, p in enumerate(params) if p.logprobs]  # noqa: B018 - the sampler's logprobs check
    return (time.process_time() - t0) / repeats * 1e6


@dataclass
class _History:
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def sampler_pass_ms(batch: int = 32, vocab: int = 32000, repeats: int = 20) -> dict[str, dict[str, list[float]]]:
    """case -> sampler -> wall ms of each of ``repeats`` passes over one [batch, vocab] batch."""
    import torch

    torch.manual_seed(0)
    logits = torch.randn(batch, vocab)
    cases = {
        "plain (temperature 1)": SamplingParams(temperature=1.0),
        "seeded": SamplingParams(temperature=1.0, seed=1),
        "top_k 50": SamplingParams(temperature=1.0, top_k=50),
        "top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    }
    out: dict[str, dict[str, list[float]]] = {}
    for name, p in cases.items():
        generators = [torch.Generator().manual_seed(i) if p.seed is not None else None for i in range(batch)]
        params, greedy = [p] * batch, [False] * batch
        out[name] = {"previous": [], "current": []}
        for _ in range(repeats):
            for label, fn in (("previous", exponential_race), ("current", sampler._sample_random)):
                t0 = time.perf_counter()
                fn(logits, params, generators, greedy)
                out[name][label].append((time.perf_counter() - t0) * 1e3)
    return out


def print_sampler_table(times: dict[str, dict[str, list[float]]]) -> None:
    print("\nthe sampler alone, one pass over [32, 32000], wall ms (min / median / max of 20)")
    print(f"{'case':24} {'previous':>24} {'current':>24} {'speed-up':>9}")
    for name, t in times.items():
        cells = [f"{min(v):.1f} / {statistics.median(v):.1f} / {max(v):.1f}" for v in (t["previous"], t["current"])]
        speedup = statistics.median(t["previous"]) / statistics.median(t["current"])
        print(f"{name:24} {cells[0]:>24} {cells[1]:>24} {speedup:8.1f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--model-dir", default=".bench-models/llama-512h-8l")
    ap.add_argument("--sampler-only", action="store_true", help="only the sampler-alone table")
    args = ap.parse_args()
    from cluster.engine.llm_engine import LLMEngine

    print(machine_line())
    print_sampler_table(sampler_pass_ms())
    if args.sampler_only:
        return 0
    model_dir = str(ensure_demo_model(args.model_dir, BENCH_SPEC))
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
            _, params, patch = table[name]
            rates[name].append(tokens_per_s(engine, prompts, params, patch))
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr)
    off_us = off_path_us_per_step(args.requests, BENCH_SPEC.vocab_size)
    token_us = 1e6 / statistics.median(rates["baseline"])
    print(
        f"\noff path, measured alone: {off_us:.1f} us of CPU per step of {args.requests} requests = "
        f"{100 * off_us / (token_us * args.requests):.3f}% of the baseline's {token_us * args.requests / 1e3:.1f} ms "
        "per step (target <= 2%)"
    )
    print(f"\n{args.requests} requests x {args.output_tokens} output tokens, {args.repeats} repeats")
    print(f"{'variant':28} {'tok/s median':>12} {'ratio min':>10} {'median':>8} {'max':>8}  (vs)")
    for name, (base, _, _) in table.items():
        ratios = [v / b for v, b in zip(rates[name], rates[base], strict=True)]
        print(
            f"{name:28} {statistics.median(rates[name]):12.1f} {min(ratios):10.3f} {statistics.median(ratios):8.3f} "
            f"{max(ratios):8.3f}  ({base})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
