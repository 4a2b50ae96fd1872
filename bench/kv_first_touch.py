"""What a KV pool whose pages are not yet backed costs the first prompts, and what backing it at start costs.

    python -m bench.kv_first_touch [--repeats 3] [--prompt-len 1536] [--kv-gib 1]

Each side runs in a fresh process (fresh memory), the two sides alternating, on the bench model in float32:

- ``backed``: the engine as it is (``cluster.engine.kv_cache`` backs the CPU pool's pages while the engine starts);
- ``unbacked``: the same engine with that backing skipped, so every page of the pool is backed by the first
  write to it, inside an engine step (what every engine did before).

Per process: the engine's start (``LLMEngine(...)``, the backing included), then four lone ``--prompt-len``-token
prompts, each on blocks no request has used, one prefill step each (``--prompt-len`` is the step's token budget):
the step's wall time, the time inside the KV cache writes, and the process's minor page faults during the step
(``getrusage``). Prints min / median / max over the repeats of each side's medians, and backed / unbacked.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.server_process import machine_line

MODEL_DIR = Path(".bench-models/llama-512h-8l")
PROMPTS = 4


def worker(side: str, prompt_len: int, kv_gib: float) -> dict:
    from bench.engine_throughput import BENCH_SPEC, greedy
    from cluster.config import CacheConfig, EngineConfig, SchedulerConfig, default_block_size
    from cluster.engine import kv_cache
    from cluster.engine.llm_engine import LLMEngine
    from cluster.tools.demo_model import ensure_demo_model

    model_dir = ensure_demo_model(MODEL_DIR, BENCH_SPEC)
    if side == "unbacked":
        kv_cache._populate_writable = lambda address, nbytes: True  # skip the backing
    block_size = default_block_size("cpu")
    start = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            num_threads=2,
            cache=CacheConfig(block_size=block_size, kv_cache_memory_gb=kv_gib),
            scheduler=SchedulerConfig(max_num_batched_tokens=prompt_len),
        )
    )
    start_s = time.perf_counter() - start
    in_kv_writes = [0.0]
    write_kv = engine.backend.write_kv

    def timed_write_kv(*args, **kwargs):
        t = time.perf_counter()
        write_kv(*args, **kwargs)
        in_kv_writes[0] += time.perf_counter() - t

    engine.backend.write_kv = timed_write_kv  # type: ignore[method-assign]
    rng = random.Random(0)
    steps = []
    for i in range(PROMPTS + 1):  # the first only warms up the kernels and the activations' memory
        engine.add_request(f"p{i}", [rng.randrange(100, 32000) for _ in range(prompt_len)], greedy(1))
        in_kv_writes[0] = 0.0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        step_s = time.perf_counter() - t
        if i:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            steps.append((step_s, in_kv_writes[0], faults))
    return {
        "start_s": start_s,
        "step_ms": statistics.median(s[0] for s in steps) * 1e3,
        "kv_write_ms": statistics.median(s[1] for s in steps) * 1e3,
        "page_faults": statistics.median(s[2] for s in steps),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=1536)
    ap.add_argument("--kv-gib", type=float, default=1.0, help="the pool's size (the server's default: 1)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.prompt_len, args.kv_gib)))
        return 0
    print(f"machine: {machine_line()}")
    print(f"{PROMPTS} lone {args.prompt_len}-token prompts per process on fresh blocks; pool {args.kv_gib} GiB")
    results: dict[str, list[dict]] = {"backed": [], "unbacked": []}
    for r in range(args.repeats):
        for side in ("backed", "unbacked") if r % 2 == 0 else ("unbacked", "backed"):
            cmd = [sys.executable, "-m", "bench.kv_first_touch", "--worker", side]
            cmd += ["--prompt-len", str(args.prompt_len), "--kv-gib", str(args.kv_gib)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"  repeat {r + 1}/{args.repeats} done", flush=True)
    rows = [
        ("engine start (pool backing included), s", "start_s"),
        ("prefill step, ms", "step_ms"),
        ("  in the KV cache writes, ms", "kv_write_ms"),
        ("  minor page faults", "page_faults"),
    ]
    print(f"\n{'':42}{'backed min/med/max':>26}{'unbacked min/med/max':>28}{'backed / unbacked':>20}")
    for name, key in rows:
        cells = []
        for side in ("backed", "unbacked"):
            values = sorted(x[key] for x in results[side])
            cells.append(f"{values[0]:8.1f}{statistics.median(values):9.1f}{values[-1]:9.1f}")
        b = statistics.median(x[key] for x in results["backed"])
        u = statistics.median(x[key] for x in results["unbacked"])
        ratio = f"{b / u:.2f}x" if u else "-"
        print(f"{name:42}{cells[0]:>26}{cells[1]:>28}{ratio:>20}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
