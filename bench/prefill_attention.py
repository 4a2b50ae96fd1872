"""CPU prefill attention: the kernel built for this host (``cpu_prefill``) against the bucketed SDPA path.

    python -m bench.prefill_attention [--repeats 5] [--threads 2] [--block-size 128] [--seed 1001]

One layer of the bench model's attention (8 heads, 4 KV heads, head size 64, float32) over the prompts
of skewed-64 (burst, ``--seed``) cut into steps of at most 2048 tokens as the engine's scheduler does
with whole prompts, and over lone prompts of 128, 256 and 1024 tokens: both implementations on the
same data, alternating within every repeat. Prints milliseconds per layer, GFLOP/s of the causal
attention math (q.K^T and P.V, a multiply-add each), and SDPA / kernel, min / median / max over the
repeats. The SDPA side is what the torch backend ran before the kernel (and runs where it is not
available): ``paged_attention_sdpa`` with the step's own K/V for prompts computed whole.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from cluster.engine.attention import cpu_prefill
from cluster.engine.attention.sdpa import GatherBuffer, paged_attention_sdpa
from cluster.tools.workloads import load_workload

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64
STEP_TOKENS = 2048


def steps_of(lengths: list[int]) -> list[list[int]]:
    steps: list[list[int]] = [[]]
    for n in lengths:
        if steps[-1] and sum(steps[-1]) + n > STEP_TOKENS:
            steps.append([])
        steps[-1].append(n)
    return steps


class Case:
    """The steps of one shape: caches holding every prompt's K/V, and each step's q/k/v and block table."""

    def __init__(self, steps: list[list[int]], block_size: int, g: torch.Generator) -> None:
        blocks = sum(-(-n // block_size) for step in steps for n in step)
        self.k_cache = torch.randn(blocks, block_size, KV_HEADS, HEAD_DIM, generator=g)
        self.v_cache = torch.randn(blocks, block_size, KV_HEADS, HEAD_DIM, generator=g)
        self.steps = []
        used = 0
        for lens in steps:
            tables = torch.zeros(len(lens), max(-(-n // block_size) for n in lens), dtype=torch.int32)
            for i, n in enumerate(lens):
                count = -(-n // block_size)
                tables[i, :count] = torch.arange(used, used + count)
                used += count
            qkv = torch.randn(sum(lens), (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g)
            q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            self.steps.append(
                (
                    tuple(lens),
                    tables,
                    q.view(-1, HEADS, HEAD_DIM),
                    k.view(-1, KV_HEADS, HEAD_DIM),
                    v.view(-1, KV_HEADS, HEAD_DIM),
                )
            )
        self.gflop = sum(n * n / 2 * HEADS * HEAD_DIM * 4 for step in steps for n in step) / 1e9

    def run(self, impl: str, buffer: GatherBuffer) -> float:
        scale = HEAD_DIM**-0.5
        start = time.perf_counter()
        for lens, tables, q, k, v in self.steps:
            if impl == "kernel":
                cpu_prefill.prefill_attention_cpu(q, self.k_cache, self.v_cache, tables, lens, lens, scale)
            else:
                paged_attention_sdpa(q, self.k_cache, self.v_cache, tables, lens, lens, scale, buffer, fresh_kv=(k, v))
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1001, help="skewed-64's burst for this seed (as shapeserve bench)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cpu_prefill.load()  # built (or found built) before anything is timed
    _, requests = load_workload("skewed-64", 32000, rate_per_s=float("inf"), seed=args.seed)
    lengths = [len(r.prompt_token_ids) for r in requests]
    g = torch.Generator().manual_seed(0)
    cases = {
        f"skewed-64 prompts ({sum(lengths)} tokens, {len(steps_of(lengths))} steps)": Case(
            steps_of(lengths), args.block_size, g
        ),
        **{f"one {n}-token prompt": Case([[n]], args.block_size, g) for n in (128, 256, 1024)},
    }
    buffer = GatherBuffer()
    print(
        f"torch threads {args.threads}, block size {args.block_size}, heads {HEADS}/{KV_HEADS} x {HEAD_DIM}, "
        f"float32; one layer; min / median / max over {args.repeats} repeats, both sides in every repeat"
    )
    print("\n| prompts | SDPA ms | kernel ms | SDPA GFLOP/s | kernel GFLOP/s | SDPA / kernel |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, case in cases.items():
        case.run("kernel", buffer), case.run("sdpa", buffer)  # warm-up: page in the outputs and buffers
        times: dict[str, list[float]] = {"sdpa": [], "kernel": []}
        for r in range(args.repeats):
            for impl in ("sdpa", "kernel") if r % 2 == 0 else ("kernel", "sdpa"):
                times[impl].append(case.run(impl, buffer))
        ratios = [s / k for s, k in zip(times["sdpa"], times["kernel"], strict=True)]

        def spread(xs: list[float], fmt: str) -> str:
            return " / ".join(format(x, fmt) for x in (min(xs), statistics.median(xs), max(xs)))

        print(
            f"| {name} | {spread([t * 1e3 for t in times['sdpa']], '.1f')} "
            f"| {spread([t * 1e3 for t in times['kernel']], '.1f')} "
            f"| {case.gflop / statistics.median(times['sdpa']):.0f} "
            f"| {case.gflop / statistics.median(times['kernel']):.0f} "
            f"| {spread(ratios, '.2f')} |"
        )


if __name__ == "__main__":
    main()
