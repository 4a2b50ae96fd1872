"""Causal prefill attention over the paged KV cache on CPU for float32: a kernel built for this host.

torch's CPU flash attention (what ``sdpa`` calls) runs its block products through a BLAS that
takes AVX2 code on AMD CPUs; ``native/prefill_attention.cc`` writes the two products as register
tiles over vectors as wide as the host's registers, reads K/V through the block table where they
lie (no gather, no padding, no mask tensors), and covers every prefill chunk of a step in one call
per layer, on the engine's threads (``python -m bench.prefill_attention`` times it against SDPA: ~2x at skewed-64's
prompts on the 2-core CI machine).

Built by ``cluster.engine.native`` when an engine starts. Where there is no compiler, or the build
fails, or the kernel disagrees with the reference, ``TorchAttentionBackend`` says why once and keeps
SDPA.

Torch reference: ``cluster.engine.attention.paged_prefill_attention_ref``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import numpy as np
import torch

from cluster.engine import native

#: Query rows per work item: small enough that a long prompt's rows spread over the threads, large
#: enough that packing its keys (once per item) stays a small share of the item's work.
ROWS_PER_ITEM = 256
#: Head sizes must be a multiple of this: the widest vector the kernel builds with (16 floats, AVX-512).
VECTOR_FLOATS = 16


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and query.shape[-1] % VECTOR_FLOATS == 0
        and query.stride(-1) == 1
        and query.stride(-2) == query.shape[-1]
    )


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The kernel built for this host (see ``cluster.engine.native``). Raises KernelUnavailable."""
    lib = native.load("prefill_attention")
    fn = lib.prefill_attention_f32
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn.argtypes = [p, i64, p, p, p, i64, p, i64, p, i32, p, p, p, i32, i32, i32, i32, ctypes.c_float, i32, i32]
    fn.restype = i32
    return lib


@functools.lru_cache(maxsize=8)
def _plan(query_lens: tuple[int, ...], seq_lens: tuple[int, ...], kv_heads: int) -> tuple[np.ndarray, ...]:
    """Per-sequence arrays and the work items, longest first (threads take them in this order).
    Every layer of a step has the same lengths, so this runs once per step."""
    q_len = np.asarray(query_lens, dtype=np.int32)
    seq_len = np.asarray(seq_lens, dtype=np.int32)
    q_start = np.zeros_like(q_len)
    np.cumsum(q_len[:-1], out=q_start[1:])
    items, cost = [], []
    for s, (q, t) in enumerate(zip(query_lens, seq_lens, strict=True)):
        first = t - q
        for begin in range(0, q, ROWS_PER_ITEM):
            end = min(q, begin + ROWS_PER_ITEM)
            for h in range(kv_heads):
                items.append((s, h, begin, end))
                cost.append((end - begin) * (first + (begin + end) / 2))
    order = np.argsort(-np.asarray(cost), kind="stable")
    return q_start, q_len, seq_len, np.ascontiguousarray(np.asarray(items, dtype=np.int32)[order])


def prefill_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's ``query_lens[i]`` rows (the last positions of its ``seq_lens[i]``
    context, whose K/V, this step's included, are in the caches).

    query: [num_tokens, num_heads, head_dim] float32, sequence by sequence, each head's row contiguous (a view
    of the fused qkv output is fine); caches: [num_blocks, block_size, kv_heads, head_dim] contiguous;
    block_tables: [num_seqs, max_blocks] int32. Returns a new contiguous tensor of ``query``'s shape.
    """
    fn = load().prefill_attention_f32
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    q_start, q_len, seq_len, items = _plan(tuple(query_lens), tuple(seq_lens), kv_heads)
    tables = block_tables if block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1 else None
    if tables is None:
        tables = block_tables.to(torch.int32).contiguous()
    out = torch.empty(query.shape, dtype=query.dtype)
    status = fn(
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        out.data_ptr(),
        out.stride(0),
        items.ctypes.data,
        len(items),
        q_start.ctypes.data,
        q_len.ctypes.data,
        seq_len.ctypes.data,
        num_heads,
        kv_heads,
        head_dim,
        block_size,
        scale,
        int(seq_len.max()),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("the CPU prefill attention kernel could not get scratch memory")
    return out
