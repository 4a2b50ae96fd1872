"""Prefill attention over the paged KV cache: ragged query chunks with a cached prefix.

Sequence i's queries are ``query[query_start_loc[i]:query_start_loc[i+1]]``, the last
``query_len`` positions of its ``seq_len`` context; its K/V (prefix and this chunk) are
already in the cache. Each query sees every cached prefix position and the chunk causally.

Design: the grid is (sequence, query block, kv head). A program takes BLOCK_Q query tokens
times the GQA group of query heads as BLOCK_M rows of one tile, so each K/V tile is loaded
once per kv head and feeds a [BLOCK_M, head_dim] x [head_dim, TILE_N] dot; online softmax
over position tiles up to the block's last query position (nothing past the diagonal is
read). Query blocks past a sequence's length exit at once (the grid is sized for the
longest chunk, which needs no device sync).

Torch reference: ``cluster.engine.attention.paged_prefill_attention_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cluster.engine.attention.triton._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cache_pair,
    check_device,
    check_same_dtype,
    check_tensor,
    dot,
    dot_config,
    next_pow2,
)

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks]
    query_start_loc_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    scale_log2,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    qblk = tl.program_id(1)
    kvh = tl.program_id(2)
    # Offsets are relative to the first entry, so a slice of a larger batch's offsets works.
    base = tl.load(query_start_loc_ptr)
    q_start = tl.load(query_start_loc_ptr + seq) - base
    q_len = tl.load(query_start_loc_ptr + seq + 1) - base - q_start
    if qblk * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # cached prefix before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    tok = qblk * BLOCK_Q + offs_m // GROUP  # query index within the chunk
    head = kvh * GROUP + offs_m % GROUP
    m_mask = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    d_mask = offs_d < HEAD_DIM
    q_pos = ctx_len + tok  # absolute position of each row's query
    row_q = (q_start + tok).to(tl.int64)
    io_mask = m_mask[:, None] & d_mask[None, :]
    # q: [BLOCK_M, BLOCK_D]
    q = tl.load(
        q_ptr + row_q[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=io_mask, other=0.0
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    kv_end = tl.minimum(seq_len, ctx_len + (qblk + 1) * BLOCK_Q)  # one past the block's last query
    for tile in range(0, kv_end, TILE_N):
        pos = tile + offs_n
        n_mask = pos < kv_end
        blk = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = pos % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        # k, v: [TILE_N, BLOCK_D]
        k = tl.load(
            k_cache_ptr + (blk * stride_kb + off * stride_kt + kvh * stride_kh)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = dot(q, tl.trans(k), DOT_UPCAST, DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        allowed = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :] & m_mask[:, None]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing allowed yet (padding rows) keep m = -inf; exp2 against 0 keeps them at 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + (blk * stride_vb + off * stride_vt + kvh * stride_vh)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_UPCAST, DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + row_q[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """Causal attention of ragged query chunks over their cached context. Does not modify the caches.

    ``max_query_len`` (host int, >= every chunk length) sizes the grid without a device sync.
    ``query_start_loc`` may be a slice of a larger batch's offsets: positions are taken
    relative to its first entry. Each seq_len must be >= its query_len. Returns ``out``.
    """
    # query: [num_tokens, num_heads, head_dim]
    # k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]
    # block_tables: [num_seqs, max_blocks] int32; query_start_loc: [num_seqs + 1] int32; seq_lens: [num_seqs] int32
    # out: [num_tokens, num_heads, head_dim]
    check_cache_pair(k_cache, v_cache)
    _, block_size, kv_heads, head_dim = k_cache.shape
    check_tensor("query", query, (None, None, head_dim), FLOAT_DTYPES)
    num_tokens, num_heads, _ = query.shape
    check_same_dtype(query=query, k_cache=k_cache)
    if num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of the cache's kv_heads ({kv_heads})")
    check_tensor("seq_lens", seq_lens, (None,), INDEX_DTYPES)
    num_seqs = seq_lens.shape[0]
    check_tensor("block_tables", block_tables, (num_seqs, None), INDEX_DTYPES)
    check_tensor("query_start_loc", query_start_loc, (num_seqs + 1,), INDEX_DTYPES)
    if out is None:
        out = torch.empty_like(query)
    check_tensor("out", out, tuple(query.shape), (query.dtype,))
    check_device(_prefill_kernel, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out)
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")

    group = num_heads // kv_heads
    if block_m is None:
        block_m = 64 if head_dim <= 128 else 32
    block_m = max(block_m, 16, next_pow2(group))
    block_q = block_m // group
    # Small chunks (and decode-like rows) don't need a full row tile.
    while block_m > 16 and block_q // 2 >= max_query_len:
        block_m //= 2
        block_q = block_m // group
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), kv_heads)
    _prefill_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_D=max(16, next_pow2(head_dim)),
        TILE_N=32,
        **dot_config(_prefill_kernel, query.dtype),
        # 8 warps keep head_dim 128 at ~190 registers per thread without spills (sm_90 cubin).
        num_warps=8 if head_dim > 64 else 4,
    )
    return out
