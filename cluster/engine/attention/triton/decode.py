"""Paged decode attention: one query token per sequence against its block table.

Design (flash-decoding): the grid is (sequence, kv head, partition). A program loads each K/V
tile of its partition once and scores it against all query heads of its GQA group at once
(a [group, head_dim] x [head_dim, tile] dot), so KV bytes are read once per kv head, not once
per query head. Long contexts are split into partitions that run in parallel and write a
partial (max, sum, unnormalized output); a second small kernel rescales the partials to a
common max and merges them. Contexts that fit one partition skip the merge and write the
final output directly.

Tiles are positions, not pages: each position finds its page through the block table, so
any block size works and the tile size is chosen for the hardware.

Torch reference: ``cluster.engine.attention.paged_decode_attention_ref``.
"""

from __future__ import annotations

import logging
import math

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
MAX_PARTITION_SIZE = 1024
MIN_PARTITION_SIZE = 128
#: K/V positions per tile. 64 halves the loop's trips: on an H200 (Triton 3.6, bf16, head dim 128) decode read KV
#: at 0.93 of a device copy against 0.82 with 32 (docs/benchmarks.md). Whether it fits the registers depends on the
#: Triton version and on what a launch specializes (an unspecialized sm_90 compile spills at 64 under Triton 3.6
#: and 3.9, a launch under 3.6 does not), so the wrapper asks each compiled variant (``_keep_tile``); 32 spills
#: in none (``python -m tests.kernels.compile_sm90``).
WIDE_TILE = 64
NARROW_TILE = 32

log = logging.getLogger(__name__)


def choose_partition_size(num_seqs: int, kv_heads: int, max_seq_len: int, num_sms: int | None) -> int:
    """Positions per partition: split long contexts until the grid has ~2 programs per SM.

    Large batches already fill the GPU, so partitions stay at 1024 (few partials to merge; on an H200, bf16, tiles
    of 32 positions, ``python -m bench.kernels --partition-size``: 64 x 2048 positions read KV at 0.82 of a device
    copy with 1024, 0.77 with 512); small batches with long contexts split further, down to 128, so every SM
    streams KV."""
    if not num_sms:
        return MAX_PARTITION_SIZE
    parts = math.ceil(2 * num_sms / max(1, num_seqs * kv_heads))
    size = next_pow2(math.ceil(max_seq_len / parts))
    return min(MAX_PARTITION_SIZE, max(MIN_PARTITION_SIZE, size))


_num_sms: dict[int, int] = {}
#: The tile each compiled variant of the partition kernel runs with, once its wide tile was tried: keyed by what
#: the variant is compiled for (device, dtype and the constexprs that shape its registers). Triton also specializes
#: on argument alignment, which the key leaves out: such a sibling runs the tile its variant kept, at worst slower.
_tile_for: dict[tuple, int] = {}


def _first_tile(query: torch.Tensor) -> int:
    """The tile a variant is tried with first: the wide one for 16-bit queries on a GPU (fp32's ieee dots need
    twice the registers, and the interpreter gains nothing from it)."""
    return WIDE_TILE if query.is_cuda and query.dtype != torch.float32 else NARROW_TILE


def _keep_tile(key: tuple, tile_n: int, compiled: object) -> None:
    """After a variant's first launch: keep its tile unless the compiler spilled registers for it."""
    spills = getattr(compiled, "n_spills", 0) or 0
    if tile_n > NARROW_TILE and spills:
        log.info(
            "Triton decode kernel: %d positions per tile spill %d bytes of registers with Triton %s on this GPU; "
            "using %d",
            tile_n,
            spills,
            triton.__version__,
            NARROW_TILE,
        )
        tile_n = NARROW_TILE
    _tile_for[key] = tile_n


def _sm_count(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _num_sms:
        _num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _num_sms[index]


@triton.jit
def _decode_partition_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]            (single-partition mode)
    part_out_ptr,  # [num_seqs, num_heads, num_parts, head_dim] fp32 (split mode)
    part_max_ptr,  # [num_seqs, num_heads, num_parts] fp32, running max (log2 domain)
    part_sum_ptr,  # [num_seqs, num_heads, num_parts] fp32
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks]
    seq_lens_ptr,  # [num_seqs]
    scale_log2,  # softmax scale * log2(e): scores live in the log2 domain (exp2 is cheaper)
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ps,
    stride_ph,
    stride_pp,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION_SIZE
    if start >= seq_len:  # the grid is sized for the longest sequence
        return
    end = tl.minimum(start + PARTITION_SIZE, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, TILE_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    # q: [BLOCK_G, BLOCK_D]; rows past the group are zeros and never stored.
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for tile in range(start, end, TILE_N):
        pos = tile + offs_n
        n_mask = pos < end
        blk = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = pos % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        # k, v: [TILE_N, BLOCK_D]
        k = tl.load(
            k_cache_ptr + (blk * stride_kb + off * stride_kt + kvh * stride_kh)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = dot(q, tl.trans(k), DOT_UPCAST, DOT_PRECISION) * scale_log2  # [BLOCK_G, TILE_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every tile holds at least one valid position, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + (blk * stride_vb + off * stride_vt + kvh * stride_vh)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_UPCAST, DOT_PRECISION)
        m_i = m_new

    store_mask = g_mask[:, None] & d_mask[None, :]
    if SINGLE_PARTITION:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        stat = seq * stride_ps + heads * stride_ph + part * stride_pp  # [BLOCK_G]
        tl.store(part_max_ptr + stat, m_i, mask=g_mask)
        tl.store(part_sum_ptr + stat, l_i, mask=g_mask)
        tl.store(part_out_ptr + stat[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store_mask)


@triton.jit
def _decode_merge_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    part_out_ptr,  # [num_seqs, num_heads, num_parts, head_dim] fp32
    part_max_ptr,  # [num_seqs, num_heads, num_parts] fp32
    part_sum_ptr,  # [num_seqs, num_heads, num_parts] fp32
    seq_lens_ptr,  # [num_seqs]
    stride_os,
    stride_oh,
    stride_ps,
    stride_ph,
    stride_pp,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, PARTITION_SIZE)
    stat = part_max_ptr + seq * stride_ps + head * stride_ph
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = offs_p < num_parts
    # Rescale every partial to the global max so no exp2 overflows; unwritten partitions are masked.
    maxes = tl.load(stat + offs_p * stride_pp, mask=p_mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + seq * stride_ps + head * stride_ph + offs_p * stride_pp, mask=p_mask, other=0.0)
    m = tl.max(maxes, 0)
    total = tl.sum(sums * tl.exp2(maxes - m), 0)

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p in range(0, num_parts):
        idx = seq * stride_ps + head * stride_ph + p * stride_pp
        w = tl.exp2(tl.load(part_max_ptr + idx) - m)
        acc += w * tl.load(part_out_ptr + idx * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
    out = acc / total
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    *,
    out: torch.Tensor | None = None,
    partition_size: int | None = None,
    tile_n: int | None = None,
) -> torch.Tensor:
    """Attends one query token per sequence to its whole context. Does not modify the caches.

    ``max_seq_len`` (host int, >= every seq_len) sizes the grid without a device sync.
    Every ``seq_lens`` entry must be >= 1. Returns ``out`` (allocated when None).
    ``tile_n``: K/V positions per tile (a power of two >= 16); by default 64 for 16-bit queries on a GPU where the
    kernel compiles without register spills (checked at each compiled variant's first launch), else 32.
    """
    # query: [num_seqs, num_heads, head_dim]
    # k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]
    # block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32
    # out: [num_seqs, num_heads, head_dim]
    check_cache_pair(k_cache, v_cache)
    _, block_size, kv_heads, head_dim = k_cache.shape
    check_tensor("query", query, (None, None, head_dim), FLOAT_DTYPES)
    num_seqs, num_heads, _ = query.shape
    check_same_dtype(query=query, k_cache=k_cache)
    if num_heads % kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of the cache's kv_heads ({kv_heads})")
    check_tensor("block_tables", block_tables, (num_seqs, None), INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, (num_seqs,), INDEX_DTYPES)
    if out is None:
        out = torch.empty_like(query)
    check_tensor("out", out, tuple(query.shape), (query.dtype,))
    check_device(_decode_partition_kernel, query, k_cache, v_cache, block_tables, seq_lens, out)
    if max_seq_len < 1 and num_seqs:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if block_tables.shape[1] * block_size < max_seq_len:
        raise ValueError(
            f"block_tables has {block_tables.shape[1]} columns x block_size {block_size} = "
            f"{block_tables.shape[1] * block_size} positions, fewer than max_seq_len {max_seq_len}"
        )
    if partition_size is None:
        partition_size = choose_partition_size(num_seqs, kv_heads, max_seq_len, _sm_count(query.device))
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    if tile_n is not None and (tile_n < 16 or tile_n & (tile_n - 1)):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
    if num_seqs == 0:
        return out

    group = num_heads // kv_heads
    num_parts = math.ceil(max_seq_len / partition_size)
    single = num_parts == 1
    block_d = max(16, next_pow2(head_dim))
    block_g = max(16, next_pow2(group))  # tl.dot needs >= 16 rows
    variant = (query.device, query.dtype, block_size, group, head_dim, partition_size, single)
    trying = tile_n is None and variant not in _tile_for
    tile = min(tile_n or _tile_for.get(variant) or _first_tile(query), partition_size)
    if single:
        part_out = part_max = part_sum = out  # unused placeholders
        ps: tuple[int, ...] = (0, 0, 0)
    else:
        part_max = torch.empty((num_seqs, num_heads, num_parts), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        part_out = torch.empty((num_seqs, num_heads, num_parts, head_dim), dtype=torch.float32, device=query.device)
        ps = part_max.stride()
    compiled = _decode_partition_kernel[(num_seqs, kv_heads, num_parts)](
        out,
        part_out,
        part_max,
        part_sum,
        query,
        k_cache,
        v_cache,
        block_tables,
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
        *ps,
        BLOCK_SIZE=block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        TILE_N=tile,
        PARTITION_SIZE=partition_size,
        SINGLE_PARTITION=single,
        **dot_config(_decode_partition_kernel, query.dtype),
        # fp32 (ieee dot) spills at 4 warps; 16-bit fits in ~190 registers (sm_90 cubin).
        num_warps=8 if query.dtype == torch.float32 else 4,
    )
    if trying:
        _keep_tile(variant, tile, compiled)
    if not single:
        _decode_merge_kernel[(num_seqs, num_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            seq_lens,
            out.stride(0),
            out.stride(1),
            *ps,
            HEAD_DIM=head_dim,
            BLOCK_D=next_pow2(head_dim),
            BLOCK_P=next_pow2(num_parts),
            PARTITION_SIZE=partition_size,
            num_warps=1 if head_dim <= 64 else 2,
        )
    return out
