"""Offline throughput: shapeserve's engine vs transformers on the same random-weight model.

    python -m bench.engine_throughput [--workload skewed-64] [--threads 2] [--one-at-a-time 8]
    python -m bench.engine_throughput --device cuda [--dtype bfloat16]   # Triton attention on a GPU

Prints output tokens/s for (1) the engine (continuous batching over the paged KV cache),
(2) transformers static batching (batch 16, left-padded, greedy), (3) transformers one
request at a time, all in the same process on the same weights, and the ratios to (2).
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from cluster.config import CacheConfig, EngineConfig, SamplingParams, SchedulerConfig, default_block_size
from cluster.dtypes import torch_dtype
from cluster.engine.llm_engine import LLMEngine
from cluster.tools.demo_model import DemoModelSpec, ensure_demo_model
from cluster.tools.workloads import load_workload

# The model the issue names: hidden 512, 8 layers, 8 heads, 4 KV heads, vocab 32000, float32.
BENCH_SPEC = DemoModelSpec(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1376,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    max_position_embeddings=2048,
    seed=0,
)


def make_engine(
    model_dir: Path, args, requests, prefix_caching: bool = True, device: str = "cpu", dtype: str = "float32"
) -> LLMEngine:
    """The engine under test, warmed up (kernels compiled, memory touched) on the first two
    requests' prompts with 4 output tokens each. A/B benches that send the same prompts to both
    sides pass ``prefix_caching=False``, so the side measured second computes them too."""
    # The block size a server on this device runs (``default_block_size``), the pool sized in tokens.
    block_size = default_block_size(device)
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            device=device,
            dtype=dtype,
            num_threads=args.threads,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=-(-args.kv_tokens // block_size),
                enable_prefix_caching=prefix_caching,
            ),
            scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256),
        )
    )
    for r in requests[:2]:
        engine.add_request(f"warm{r.index}", list(r.prompt_token_ids), greedy(4))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_engine(model_dir: Path, requests, args) -> tuple[float, int]:
    engine = make_engine(model_dir, args, requests, device=args.device, dtype=args.dtype)
    start = time.perf_counter()
    for r in requests:
        engine.add_request(str(r.index), list(r.prompt_token_ids), greedy(r.output_tokens))
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - start, produced


def _hf_generate(model, batch, max_new_tokens) -> int:
    longest = max(len(r.prompt_token_ids) for r in batch)
    device = next(model.parameters()).device
    ids = torch.full((len(batch), longest), 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(batch):  # left padding
        ids[i, longest - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
        mask[i, longest - len(r.prompt_token_ids) :] = 1
    with torch.inference_mode():
        out = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return (out.shape[1] - longest) * len(batch)


def run_hf(model_dir: Path, requests, batch_size: int, device: str, dtype: str) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype)).eval()
    model.to(torch.device(device))
    _hf_generate(model, requests[:2], 4)  # warm-up
    start = time.perf_counter()
    produced = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        produced += _hf_generate(model, batch, max(r.output_tokens for r in batch))
    return time.perf_counter() - start, produced


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return platform.processor() or platform.machine()


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workload", default="skewed-64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model-dir", default=".bench-models/llama-512h-8l")
    ap.add_argument("--kv-tokens", type=int, default=32768, help="KV pool size in tokens")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument(
        "--one-at-a-time", type=int, default=8, help="requests timed for the one-at-a-time baseline (0: skip)"
    )
    ap.add_argument("--skip-hf", action="store_true", help="engine only (for profiling)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the engine then runs its Triton attention")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    model_dir = ensure_demo_model(args.model_dir, BENCH_SPEC)
    spec, requests = load_workload(args.workload, BENCH_SPEC.vocab_size)
    print(
        f"workload {spec['name']}: {len(requests)} requests, "
        f"{sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
        f"{sum(r.output_tokens for r in requests)} output tokens; model hidden {BENCH_SPEC.hidden_size}, "
        f"{BENCH_SPEC.num_layers} layers, vocab {BENCH_SPEC.vocab_size}, {args.dtype}; torch threads {args.threads}; "
        f"{device_name(args.device)}"
    )

    rows = []
    secs, toks = run_engine(model_dir, requests, args)
    rows.append(("shapeserve engine (continuous batching, paged KV)", secs, toks))
    if not args.skip_hf:
        secs, toks = run_hf(model_dir, requests, args.hf_batch_size, args.device, args.dtype)
        rows.append((f"transformers static batching (batch {args.hf_batch_size}, left-padded)", secs, toks))
        if args.one_at_a_time:
            subset = requests[: args.one_at_a_time]
            secs, toks = run_hf(model_dir, subset, 1, args.device, args.dtype)
            rows.append((f"transformers one at a time (first {len(subset)} requests)", secs, toks))

    base = rows[1][2] / rows[1][1] if len(rows) > 1 else None
    print(f"\n{'system':<58} {'seconds':>8} {'out tokens':>10} {'tok/s':>8} {'vs static':>9}")
    for name, secs, toks in rows:
        rate = toks / secs
        ratio = f"{rate / base:8.2f}x" if base else "      -"
        print(f"{name:<58} {secs:8.1f} {toks:10d} {rate:8.1f} {ratio}")


if __name__ == "__main__":
    main()
