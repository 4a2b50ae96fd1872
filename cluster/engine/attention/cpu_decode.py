"""Paged decode attention on CPU for float32 KV: one compiled pass over each sequence's own blocks.

Decode attention reads every cached K/V byte of every running sequence once per layer and
does little arithmetic on it, so its cost is memory traffic. SDPA needs each sequence's
context as one strided tensor, which means gathering the blocks into a copy first (read,
write, read again); this kernel walks the block table and reads K/V where they lie, and
on the 2-core CI machine it is 2-2.5x faster than the gather + SDPA path at the
skewed-64 decode shape (``python -m bench.kernels --device cpu --torch-only ...`` rows).
Compiled by numba (LLVM) when an engine starts (``TorchAttentionBackend.warm_up``) and
cached on disk.

Torch reference: ``cluster.engine.attention.paged_decode_attention_ref``.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from cluster.engine.numba_launch import parallel_launch


@numba.njit(fastmath=True, cache=True, inline="always")
def _decode_one(s, query, k_cache, v_cache, block_tables, seq_lens, out):  # pragma: no cover - compiled
    # query, out: [S, Hkv, G, D] float32, query already multiplied by the softmax scale
    # k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: [S, max_blocks]; seq_lens: [S]
    _, kv_heads, group, head_dim = query.shape
    block_size = k_cache.shape[1]
    seq_len = seq_lens[s]
    num_blocks = (seq_len + block_size - 1) // block_size
    scores = np.empty((kv_heads, group, num_blocks * block_size), np.float32)
    # Pass 1: scores. A block's tokens are contiguous [Hkv, D] rows, read once for all heads.
    for b in range(num_blocks):
        block = block_tables[s, b]
        for t in range(min(block_size, seq_len - b * block_size)):
            for h in range(kv_heads):
                for g in range(group):
                    acc = np.float32(0.0)
                    for d in range(head_dim):
                        acc += query[s, h, g, d] * k_cache[block, t, h, d]
                    scores[h, g, b * block_size + t] = acc
    # Softmax over the whole context (it is at most a few thousand floats per head).
    for h in range(kv_heads):
        for g in range(group):
            top = scores[h, g, 0]
            for t in range(1, seq_len):
                top = max(top, scores[h, g, t])
            total = np.float32(0.0)
            for t in range(seq_len):
                e = np.exp(scores[h, g, t] - top)
                scores[h, g, t] = e
                total += e
            inv = np.float32(1.0) / total
            for t in range(seq_len):
                scores[h, g, t] *= inv
    # Pass 2: probabilities x V, accumulated in float32.
    acc_out = np.zeros((kv_heads, group, head_dim), np.float32)
    for b in range(num_blocks):
        block = block_tables[s, b]
        for t in range(min(block_size, seq_len - b * block_size)):
            for h in range(kv_heads):
                for g in range(group):
                    p = scores[h, g, b * block_size + t]
                    for d in range(head_dim):
                        acc_out[h, g, d] += p * v_cache[block, t, h, d]
    out[s] = acc_out


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _decode_parallel(query, k_cache, v_cache, block_tables, seq_lens, out):  # pragma: no cover - compiled
    for s in numba.prange(query.shape[0]):
        _decode_one(s, query, k_cache, v_cache, block_tables, seq_lens, out)


@numba.njit(fastmath=True, cache=True, nogil=True)
def _decode_serial(query, k_cache, v_cache, block_tables, seq_lens, out):  # pragma: no cover - compiled
    for s in range(query.shape[0]):
        _decode_one(s, query, k_cache, v_cache, block_tables, seq_lens, out)


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel can run these inputs (float32, CPU, contiguous caches)."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and k_cache.dtype == torch.float32
        and k_cache.is_contiguous()
    )


def paged_decode_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence. query [num_seqs, num_heads, head_dim] -> same shape.

    k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim] float32, contiguous;
    block_tables: [num_seqs, >= blocks used] int32; seq_lens: [num_seqs] int32 (>= 1).
    Does not modify the caches.
    """
    num_seqs, num_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    if not supports(query, k_cache) or not v_cache.is_contiguous() or num_heads % kv_heads:
        raise ValueError(
            f"paged_decode_attention_cpu needs float32 CPU tensors and contiguous caches, got query "
            f"{query.dtype}/{query.device}, caches {k_cache.dtype} contiguous={k_cache.is_contiguous()}"
        )
    q = (query * scale).view(num_seqs, kv_heads, num_heads // kv_heads, head_dim)
    out = torch.empty_like(q)
    args = (
        q.numpy(),
        k_cache.numpy(),
        v_cache.numpy(),
        # Contiguous int32 always, so numba compiles (and caches) one specialization only.
        block_tables.to(torch.int32).contiguous().numpy(),
        seq_lens.to(torch.int32).contiguous().numpy(),
        out.numpy(),
    )
    if num_seqs == 1:
        # Sequences are what the parallel kernel splits over threads: one sequence runs on one thread anyway, and
        # skipping the pool launch took a call from 0.083 to 0.061 ms on the CI machine (bench.kernels --device cpu
        # --torch-only --batch 1 --context 256 --num-heads 8 --kv-heads 4 --head-dim 64 --repeats 300).
        _decode_serial(*args)
    else:
        with parallel_launch():
            _decode_parallel(*args)
    return out.view(num_seqs, num_heads, head_dim)
