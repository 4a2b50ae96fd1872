"""Times the Triton attention kernels against the torch reference and SDPA over the same data.

    python -m bench.kernels                      # CUDA if present, else CPU (Triton interpreter)
    python -m bench.kernels --device cpu --torch-only
    python -m bench.kernels --device cuda --batch 64 --context 2048 --dtype bfloat16
    python -m bench.kernels --device cuda --batch 16 --context 4096 --partition-size 512

Prints a markdown table: time per call, and for the memory-bound kernels the achieved bandwidth
(decode: bytes of K and V read / time). On CUDA it also measures a plain device-to-device copy
and prints decode bandwidth as a fraction of it (the goal: >= 0.8 at batch 64, context 2048, bf16).

SDPA runs on K/V already gathered into contiguous [batch, kv_heads, context, head_dim] tensors,
i.e. the same numbers without paging: the bound a paged kernel should approach.
On CPU the Triton kernels run in the interpreter (numpy per program): their CPU times measure
the interpreter, not a kernel, and only show that the path runs end to end.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.engine.attention import cpu_decode, cpu_prefill, native_decode
from cluster.engine.attention.base import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref
from cluster.engine.attention.sdpa import GatherBuffer, paged_attention_sdpa

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (batch, context, num_heads, kv_heads, head_dim, dtype, prefill_seqs, prefill_query)
DEFAULTS = {
    "cuda": (64, 2048, 32, 8, 128, "bfloat16", 4, 512),
    "cpu": (4, 256, 8, 2, 64, "float32", 2, 64),
}


@dataclass
class Row:
    kernel: str
    impl: str
    ms: float
    gbps: float | None = None  # bytes moved / time
    of_copy: float | None = None  # gbps / device copy bandwidth
    max_err: float | None = None  # vs the torch reference


#: CUDA calls timed back to back per repeat: one call between two events also times the host's launch of it
#: (the wrappers' checks and allocations), which for a ~0.1 ms kernel read as a third of its time.
CUDA_CALLS_PER_REPEAT = 10


def timeit(fn, device: str, warmup: int, repeats: int) -> float:
    """Median milliseconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        for _ in range(repeats):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(CUDA_CALLS_PER_REPEAT):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / CUDA_CALLS_PER_REPEAT)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def paged(num_seqs, context, kv_heads, head_dim, block_size, dtype, device, g):
    """Random caches holding num_seqs x context tokens in shuffled blocks, plus their tables."""
    blocks_per_seq = -(-context // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    k_cache = torch.randn((num_blocks, block_size, kv_heads, head_dim), generator=g).to(device, dtype)
    v_cache = torch.randn((num_blocks, block_size, kv_heads, head_dim), generator=g).to(device, dtype)
    ids = torch.randperm(num_blocks, generator=g)[: num_seqs * blocks_per_seq]
    tables = ids.view(num_seqs, blocks_per_seq).to(device, torch.int32)
    return k_cache, v_cache, tables


def gather(cache, tables):
    # [num_blocks, block_size, kv_heads, head_dim] -> [num_seqs, kv_heads, context, head_dim], contiguous
    return cache[tables.long()].flatten(1, 2).transpose(1, 2).contiguous()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--torch-only", action="store_true", help="skip the Triton kernels (no interpreter on CPU)")
    ap.add_argument("--batch", type=int, help="decode sequences")
    ap.add_argument("--context", type=int, help="tokens of context per sequence (decode and prefill)")
    ap.add_argument("--num-heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--dtype", choices=sorted(DTYPES))
    ap.add_argument("--prefill-seqs", type=int, help="prefill sequences")
    ap.add_argument("--prefill-query", type=int, help="new tokens per prefill sequence (the rest is cached prefix)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--partition-size", type=int, help="Triton decode: positions per partition (default: the wrapper's choice)"
    )
    ap.add_argument(
        "--tile-n", type=int, help="Triton decode: K/V positions per tile (default: the wrapper's choice, 64 or 32)"
    )
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--threads", type=int, help="torch CPU threads (1 gives steadier times on a shared host)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and not args.torch_only:
        # Triton reads this when the kernels are decorated, i.e. on the import below.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    d = DEFAULTS[device]
    batch = args.batch or d[0]
    context = args.context or d[1]
    num_heads, kv_heads, head_dim = args.num_heads or d[2], args.kv_heads or d[3], args.head_dim or d[4]
    dtype = DTYPES[args.dtype or d[5]]
    p_seqs, p_query = args.prefill_seqs or d[6], min(args.prefill_query or d[7], context)
    warmup = args.warmup if args.warmup is not None else (5 if device == "cuda" else 1)
    repeats = args.repeats or (20 if device == "cuda" else 3)
    bs = args.block_size
    scale = head_dim**-0.5
    esize = torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator().manual_seed(0)
    t = lambda fn: timeit(fn, device, warmup, repeats)  # noqa: E731

    if not args.torch_only:
        from cluster.engine.attention.triton import decode as triton_decode
        from cluster.engine.attention.triton.decode import paged_decode_attention
        from cluster.engine.attention.triton.kv_write import write_kv
        from cluster.engine.attention.triton.prefill import paged_prefill_attention

    rows: list[Row] = []
    copy_gbps = None
    if device == "cuda":
        # Device-to-device copy: the bandwidth a memory-bound kernel can hope for (read + write bytes).
        src = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_ms = t(lambda: dst.copy_(src))
        copy_gbps = 2 * src.numel() / copy_ms / 1e6
        rows.append(Row("d2d copy", "torch copy_", copy_ms, copy_gbps, 1.0))
        del src, dst

    # ---- KV write: one prefill step's tokens into shuffled slots ----
    n_tok = p_seqs * p_query
    kc, vc, _ = paged(p_seqs, context, kv_heads, head_dim, bs, dtype, device, g)
    key = torch.randn((n_tok, kv_heads, head_dim), generator=g).to(device, dtype)
    value = torch.randn((n_tok, kv_heads, head_dim), generator=g).to(device, dtype)
    slots = torch.randperm(kc.shape[0] * bs, generator=g)[:n_tok].to(device)
    moved = 2 * 2 * key.numel() * esize  # K and V, read and written
    ms = t(lambda: write_kv_ref(key, value, kc, vc, slots))
    rows.append(Row(f"write_kv ({n_tok} tok)", "torch index_copy_", ms, moved / ms / 1e6))
    if not args.torch_only:
        ms = t(lambda: write_kv(key, value, kc, vc, slots))
        rows.append(Row(f"write_kv ({n_tok} tok)", "triton", ms, moved / ms / 1e6))
    del kc, vc

    # ---- decode: batch x 1 query against context tokens each ----
    kc, vc, tables = paged(batch, context, kv_heads, head_dim, bs, dtype, device, g)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn((batch, num_heads, head_dim), generator=g).to(device, dtype)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * esize
    name = f"decode (B={batch}, ctx={context})"

    def bw(ms: float) -> dict[str, float | None]:
        gbps = kv_bytes / ms / 1e6
        return {"gbps": gbps, "of_copy": gbps / copy_gbps if copy_gbps else None}

    ref = paged_decode_attention_ref(q, kc, vc, tables, lens, scale, context)
    ms = t(lambda: paged_decode_attention_ref(q, kc, vc, tables, lens, scale, context))
    rows.append(Row(name, "torch reference", ms, **bw(ms)))
    k_dense, v_dense = gather(kc, tables), gather(vc, tables)
    q4 = q.unsqueeze(2)  # [B, H, 1, D]
    sdpa = lambda: F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale, enable_gqa=True)  # noqa: E731
    ms = t(sdpa)
    rows.append(Row(name, "SDPA (dense K/V)", ms, **bw(ms), max_err=err(sdpa().squeeze(2), ref)))
    del k_dense, v_dense
    # The torch backend's own paths: the compiled CPU decode kernel (float32 CPU) and bucketed SDPA.
    buf = GatherBuffer()
    dec_sdpa = lambda: paged_attention_sdpa(q, kc, vc, tables, [1] * batch, [context] * batch, scale, buf)  # noqa: E731
    ms = t(dec_sdpa)
    rows.append(Row(name, "torch backend: bucketed SDPA", ms, **bw(ms), max_err=err(dec_sdpa(), ref)))
    if cpu_decode.supports(q, kc):
        dec_cpu = lambda: cpu_decode.paged_decode_attention_cpu(q, kc, vc, tables, lens, scale)  # noqa: E731
        ms = t(dec_cpu)
        rows.append(Row(name, "torch backend: numba decode kernel", ms, **bw(ms), max_err=err(dec_cpu(), ref)))
    if native_decode.supports(q, kc, vc):
        dec_native = lambda: native_decode.paged_decode_attention_native(q, kc, vc, tables, lens, scale)  # noqa: E731
        ms = t(dec_native)
        rows.append(Row(name, "torch backend: host-built decode kernel", ms, **bw(ms), max_err=err(dec_native(), ref)))
    if not args.torch_only:
        out = torch.empty_like(q)
        dec = lambda: paged_decode_attention(  # noqa: E731
            q, kc, vc, tables, lens, scale, context, out=out, partition_size=args.partition_size, tile_n=args.tile_n
        )
        ms = t(dec)
        tiles = sorted(set(triton_decode._tile_for.values())) if args.tile_n is None else [args.tile_n]
        label = f"triton (tile {'/'.join(map(str, tiles))})"  # the wrapper's choice: 64 unless it spills here
        rows.append(Row(name, label, ms, **bw(ms), max_err=err(dec(), ref)))
    del kc, vc

    # ---- prefill: p_seqs chunks of p_query new tokens after a cached prefix ----
    kc, vc, tables = paged(p_seqs, context, kv_heads, head_dim, bs, dtype, device, g)
    lens = torch.full((p_seqs,), context, dtype=torch.int32, device=device)
    starts = torch.arange(0, (p_seqs + 1) * p_query, p_query, dtype=torch.int32, device=device)
    q = torch.randn((n_tok, num_heads, head_dim), generator=g).to(device, dtype)
    name = f"prefill ({p_seqs}x{p_query} new, ctx={context})"
    ref = paged_prefill_attention_ref(q, kc, vc, tables, starts, lens, scale, (p_query,) * p_seqs, context)
    ms = t(lambda: paged_prefill_attention_ref(q, kc, vc, tables, starts, lens, scale, (p_query,) * p_seqs, context))
    rows.append(Row(name, "torch reference", ms))
    k_dense, v_dense = gather(kc, tables), gather(vc, tables)
    q4 = q.view(p_seqs, p_query, num_heads, head_dim).transpose(1, 2)
    # Bottom-right causal: query r sits at position context - p_query + r.
    mask = torch.ones(p_query, context, dtype=torch.bool, device=device).tril(context - p_query)
    sdpa = lambda: F.scaled_dot_product_attention(q4, k_dense, v_dense, attn_mask=mask, scale=scale, enable_gqa=True)  # noqa: E731
    ms = t(sdpa)
    rows.append(Row(name, "SDPA (dense K/V)", ms, None, None, err(sdpa().transpose(1, 2).flatten(0, 1), ref)))
    q_lens, t_lens = [p_query] * p_seqs, [context] * p_seqs
    pre_sdpa = lambda: paged_attention_sdpa(q, kc, vc, tables, q_lens, t_lens, scale, buf)  # noqa: E731
    ms = t(pre_sdpa)
    rows.append(Row(name, "torch backend: bucketed SDPA", ms, None, None, err(pre_sdpa(), ref)))
    if cpu_prefill.supports(q, kc, vc):
        pre_native = lambda: cpu_prefill.prefill_attention_cpu(q, kc, vc, tables, q_lens, t_lens, scale)  # noqa: E731
        ms = t(pre_native)
        rows.append(Row(name, "torch backend: host-built prefill kernel", ms, None, None, err(pre_native(), ref)))
    if not args.torch_only:
        out = torch.empty_like(q)
        pre = lambda: paged_prefill_attention(q, kc, vc, tables, starts, lens, scale, p_query, out=out)  # noqa: E731
        ms = t(pre)
        rows.append(Row(name, "triton", ms, None, None, err(pre(), ref)))

    interp = device == "cpu" and not args.torch_only
    where = torch.cuda.get_device_name() if device == "cuda" else f"{cpu_name()}, {os.cpu_count()} cores"
    mode = (
        "torch only"
        if args.torch_only
        else ("TRITON_INTERPRET=1 (Triton times are interpreter times)" if interp else "native Triton")
    )
    print(
        f"device: {device} ({where}); torch {torch.__version__}; dtype {str(dtype).removeprefix('torch.')}; "
        f"heads {num_heads}/{kv_heads} x {head_dim}; block {bs}; "
        f"{mode}; torch threads {torch.get_num_threads()}; "
        f"median of {repeats} after {warmup} warmup"
        + (f" (each repeat {CUDA_CALLS_PER_REPEAT} calls back to back)" if device == "cuda" else "")
    )
    print()
    print("| kernel | impl | ms | GB/s | of copy | max err vs ref |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
        print(
            f"| {r.kernel} | {r.impl} | {r.ms:.3f} | {fmt(r.gbps, '.3g')} | {fmt(r.of_copy, '.2f')} "
            f"| {fmt(r.max_err, '.1e')} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
