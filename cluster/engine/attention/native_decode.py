"""Paged decode attention on CPU for float32 KV: the kernel built for this host (``native/decode_attention.cc``).

It does what ``cpu_decode`` (numba) does, one query token per sequence against its cached context
read through the block table, on torch's own OpenMP threads, with the dot products as vector FMAs
summed across lanes a vector's width of keys at a time; ``python -m bench.kernels --device cpu
--torch-only`` times both. ``TorchAttentionBackend`` takes it where it builds and agrees with the reference, else
numba's, else SDPA.

Torch reference: ``cluster.engine.attention.paged_decode_attention_ref``.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from cluster.engine import native

#: Head sizes the kernel is instantiated for: 16 to 128, in steps of 16 (whole vectors at any width it builds for).
HEAD_DIMS = tuple(range(16, 129, 16))
#: Query heads per layer the kernel's scratch is sized for.
MAX_HEADS = 64


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and query.shape[-1] in HEAD_DIMS
        and query.shape[-2] <= MAX_HEADS
        and query.stride(-1) == 1
        and query.stride(-2) == query.shape[-1]
    )


@functools.lru_cache(maxsize=1)
def load() -> ctypes.CDLL:
    """The kernel built for this host (see ``cluster.engine.native``). Raises KernelUnavailable."""
    lib = native.load("decode_attention")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.decode_attention_f32.argtypes = [
        p,
        i64,
        p,
        p,
        p,
        i64,
        p,
        p,
        i32,
        i32,
        i32,
        i32,
        i32,
        ctypes.c_float,
        p,
        i32,
        i32,
    ]
    lib.decode_attention_f32.restype = i32
    return lib


@functools.lru_cache(maxsize=64)
def _items(num_seqs: int, kv_heads: int, threads: int) -> np.ndarray:
    """(sequence, first KV head, end KV head) per work item, threads taking them in this order: a sequence whole
    (its tokens' K/V rows are read in order) while there are enough sequences to share out, else a KV head each."""
    if num_seqs >= 2 * threads:
        return np.ascontiguousarray(
            np.stack([np.arange(num_seqs), np.zeros(num_seqs, np.int64), np.full(num_seqs, kv_heads)], axis=1),
            dtype=np.int32,
        )
    seqs, heads = np.meshgrid(np.arange(num_seqs), np.arange(kv_heads), indexing="ij")
    return np.ascontiguousarray(np.stack([seqs.ravel(), heads.ravel(), heads.ravel() + 1], axis=1), dtype=np.int32)


def paged_decode_attention_native(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """One query token per sequence. query [num_seqs, num_heads, head_dim] (rows may be strided, as sliced out of
    the fused qkv) -> a new contiguous tensor of that shape. k_cache, v_cache: [num_blocks, block_size, kv_heads,
    head_dim] float32, contiguous; block_tables: [num_seqs, >= blocks used] int32; seq_lens: [num_seqs] (>= 1).
    Does not modify the caches."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if not supports(query, k_cache, v_cache) or num_heads % kv_heads:
        raise ValueError(
            f"the native decode kernel needs float32 CPU tensors, contiguous caches and a head size in {HEAD_DIMS}, "
            f"got query {query.dtype}/{query.device} of head size {head_dim}"
        )
    tables = block_tables if block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1 else None
    if tables is None:
        tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if max_seq_len is None:
        max_seq_len = int(lens.max())
    threads = torch.get_num_threads()
    items = _items(num_seqs, kv_heads, threads)
    out = torch.empty(query.shape, dtype=torch.float32)
    status = load().decode_attention_f32(
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.stride(0),
        lens.data_ptr(),
        items.ctypes.data,
        len(items),
        num_heads,
        kv_heads,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        max_seq_len,
        threads,
    )
    if status != 0:
        raise MemoryError("the native decode attention kernel could not get scratch memory")
    return out
