"""What KV block size costs a CPU decode once a server's blocks lie scattered.

    .venv/bin/python -m bench.block_layout [--block-sizes 16,128] [--batch 32] [--context 282] [--repeats 5]

A fresh engine hands a prompt the pool's blocks in order, so a sequence's K/V is one contiguous run and the
CPU's prefetchers stream it. The pool reuses blocks least recently freed first (the prefix cache's LRU), so
after a server has run a while a sequence's blocks lie wherever the pool had them, and the decode attention
kernel jumps at every block's end. Two tables, each a median over ``--repeats`` with the two layouts measured
alternately:

1. the CPU decode kernel (``cpu_decode``) alone on one layer of a pool sized like the engine's default
   (1 GiB of KV for the bench model: 64 MiB per layer's keys), ``--batch`` sequences of ``--context`` tokens,
   in contiguous blocks and in blocks drawn at random from the whole pool (a new draw each call, so no run
   reads what the last one left in the caches);
2. the engine (the bench model, float32, 2 threads): the decode step at ``--batch`` sequences, in a fresh
   engine and in one whose pool was first churned by a burst of requests of mixed lengths that end at
   different times (as a server's pool is).

Prints, per block size, both layouts and scattered / contiguous; the smaller that ratio, the less a
server's steady state costs its decodes.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

from cluster.engine.attention import cpu_decode

#: The bench model's attention shape (``bench.engine_throughput.BENCH_SPEC``).
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64
#: One layer's keys in the default 1 GiB pool of the bench model (8 layers, K and V).
LAYER_BYTES = 64 << 20


def kernel_ms(block_size: int, batch: int, context: int, repeats: int, rng: torch.Generator) -> dict[str, float]:
    """The decode kernel on one layer, contiguous vs scattered blocks: median ms per call of each layout."""
    num_blocks = LAYER_BYTES // (block_size * KV_HEADS * HEAD_DIM * 4)
    shape = (num_blocks, block_size, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=rng), torch.randn(shape, generator=rng)
    per_seq = -(-context // block_size)
    need = batch * per_seq
    if need > num_blocks:
        raise SystemExit(f"{batch} x {context} tokens do not fit one layer's pool of {num_blocks} blocks")
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=rng)
    lens = torch.full((batch,), context, dtype=torch.int32)

    def tables(layout: str) -> torch.Tensor:
        if layout == "contiguous":
            start = int(torch.randint(0, num_blocks - need + 1, (1,), generator=rng))
            ids = torch.arange(start, start + need)
        else:
            ids = torch.randperm(num_blocks, generator=rng)[:need]
        return ids.view(batch, per_seq).to(torch.int32)

    def call(layout: str) -> float:
        t = tables(layout)
        start = time.perf_counter()
        cpu_decode.paged_decode_attention_cpu(query, k_cache, v_cache, t, lens, HEAD_DIM**-0.5)
        return (time.perf_counter() - start) * 1e3

    call("contiguous")  # compiles (or loads) the kernel
    times: dict[str, list[float]] = {"contiguous": [], "scattered": []}
    for i in range(repeats * 20):
        for layout in ("contiguous", "scattered") if i % 2 == 0 else ("scattered", "contiguous"):
            times[layout].append(call(layout))
    return {layout: statistics.median(v) for layout, v in times.items()}


def engine_ms(block_size: int, batch: int, context: int, repeats: int, seed: int) -> dict[str, float]:
    """The engine's decode step at ``batch`` sequences: fresh pool, then after churning it."""
    from bench.compare_engines import MODEL_DIR, VOCAB_SIZE
    from bench.engine_throughput import BENCH_SPEC, greedy
    from cluster.config import EngineConfig
    from cluster.engine.llm_engine import LLMEngine
    from cluster.tools.demo_model import ensure_demo_model

    model_dir = ensure_demo_model(MODEL_DIR, BENCH_SPEC)
    engine = LLMEngine(EngineConfig.build(str(model_dir), device="cpu", num_threads=2, block_size=block_size))
    rng = random.Random(seed)
    tag = iter(range(1 << 30))

    def decode_step_ms() -> float:
        ids = [f"d{next(tag)}" for _ in range(batch)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(100, VOCAB_SIZE) for _ in range(context)], greedy(12))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
            engine.step()
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times[1:-1])

    def churn() -> None:
        """Requests of mixed prompt and output lengths, all at once: they end, and free their blocks, in an order
        unrelated to the one they took them in (what a server's traffic does to the pool)."""
        for _ in range(3):
            for _ in range(48):
                prompt = [rng.randrange(100, VOCAB_SIZE) for _ in range(rng.randrange(16, 600))]
                engine.add_request(f"c{next(tag)}", prompt, greedy(rng.randrange(1, 40)))
            while engine.has_unfinished_requests():
                engine.step()

    decode_step_ms()  # warm-up
    fresh = statistics.median(decode_step_ms() for _ in range(repeats))
    churn()
    churned = statistics.median(decode_step_ms() for _ in range(repeats))
    return {"fresh": fresh, "churned": churned}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-sizes", default="16,128")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=282, help="tokens per sequence (skewed-64's mean prompt + 27)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-engine", action="store_true", help="only the kernel table")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    sizes = [int(s) for s in args.block_sizes.split(",")]
    kv_bytes = 2 * args.batch * args.context * KV_HEADS * HEAD_DIM * 4
    print(f"{os.cpu_count()} CPUs; batch {args.batch} x {args.context} tokens; medians; nothing else of ours running")
    print("\ndecode kernel, one layer (64 MiB of keys per layer)")
    print(f"{'block size':>10} {'contiguous ms':>14} {'scattered ms':>13} {'scattered GB/s':>15} {'ratio':>6}")
    g = torch.Generator().manual_seed(args.seed)
    for bs in sizes:
        r = kernel_ms(bs, args.batch, args.context, args.repeats, g)
        ratio = r["scattered"] / r["contiguous"]
        gbps = kv_bytes / r["scattered"] / 1e6
        print(f"{bs:>10} {r['contiguous']:>14.3f} {r['scattered']:>13.3f} {gbps:>15.1f} {ratio:>5.2f}x")
    if args.skip_engine:
        return 0
    print("\nengine decode step (bench model, 8 layers, 2 threads)")
    print(f"{'block size':>10} {'fresh pool ms':>14} {'churned ms':>11} {'ratio':>6}")
    for bs in sizes:
        r = engine_ms(bs, args.batch, args.context, args.repeats, args.seed)
        print(f"{bs:>10} {r['fresh']:>14.2f} {r['churned']:>11.2f} {r['churned'] / r['fresh']:>5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
