"""KV-cache write: scatter this step's new K/V rows into their slots of the paged caches.

Torch reference: ``cluster.engine.attention.write_kv_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cluster.engine.attention.triton._common import (
    FLOAT_DTYPES,
    check_cache_pair,
    check_device,
    check_tensor,
    next_pow2,
)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, kv_heads, head_dim]
    value_ptr,  # [num_tokens, kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_vcb,
    stride_vct,
    stride_vch,
    BLOCK_SIZE: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: all of its heads move in one masked tile.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token (e.g. a CUDA-graph batch padded to a fixed size)
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes key/value rows into their cache slots (cast to the cache dtype). Modifies only those slots.

    Slots must lie in ``[0, num_blocks * block_size)`` (not checked: that would sync the device);
    a negative slot skips its token.
    """
    # key, value: [num_tokens, kv_heads, head_dim]
    # k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]
    # slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset
    check_cache_pair(k_cache, v_cache)
    _, block_size, kv_heads, head_dim = k_cache.shape
    check_tensor("key", key, (None, kv_heads, head_dim), FLOAT_DTYPES)
    num_tokens = key.shape[0]
    check_tensor("value", value, (num_tokens, kv_heads, head_dim), FLOAT_DTYPES)
    check_tensor("slot_mapping", slot_mapping, (num_tokens,), (torch.int64, torch.int32))
    check_device(_write_kv_kernel, key, value, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    if key.dtype != k_cache.dtype:
        # Rare (the engine writes in the cache dtype); torch's cast rounds exactly as the reference.
        key, value = key.to(k_cache.dtype), value.to(k_cache.dtype)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_SIZE=block_size,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(kv_heads),
        BLOCK_D=next_pow2(head_dim),
    )
