"""Each CPU attention kernel checked against the torch reference before an engine uses it.

``TorchAttentionBackend`` calls these once (at ``warm_up``) for the kernels its dtype and device
could use: each builds or compiles its kernel (or finds it built) and runs it on fresh random
inputs shaped to reach its different paths (serial and parallel, the ways it splits work, GQA,
cached prefixes, partial tiles and blocks). Each returns "" if the kernel can be used, else why not.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from cluster.engine.attention import cpu_prefill, native_decode
from cluster.engine.attention.base import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref
from cluster.engine.native import KernelUnavailable, elementwise


@functools.lru_cache(maxsize=1)
def numba_decode() -> ModuleType | None:
    """numba's decode kernel module (``cpu_decode``), imported only when an engine falls back to it: numba's import
    alone took ~0.6 s of a replica's start on a 2-core VM. None where numba cannot be imported."""
    try:
        from cluster.engine.attention import cpu_decode
    except ImportError:  # pragma: no cover - numba is a declared dependency
        return None
    return cpu_decode


def _failure(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def _differs(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
        return f"its output differs from the reference by {float((got - want).abs().max()):.2e}"
    return ""


def _check_decode(decode: Callable[..., torch.Tensor]) -> str:
    g = torch.Generator().manual_seed(0)
    # One sequence (split by KV head, on one thread), then eight long ones (whole sequences, in parallel),
    # over blocks of 7 tokens so that tiles and blocks end apart.
    for num_seqs, context in ((1, 20), (8, 300)):
        blocks = -(-context // 7)
        k_cache, v_cache = torch.randn(2, num_seqs * blocks + 3, 7, 2, 32, generator=g).unbind(0)
        tables = torch.randperm(num_seqs * blocks + 3, generator=g)[: num_seqs * blocks].view(num_seqs, blocks)
        seq_lens = torch.randint(1, context + 1, (num_seqs,), generator=g, dtype=torch.int32)
        seq_lens[0] = context
        query = torch.randn(num_seqs, 6, 32, generator=g)[:, 1:5]  # strided, as sliced out of qkv
        args = (query, k_cache, v_cache, tables.to(torch.int32), seq_lens, 0.2)
        try:
            got = decode(*args)
        except Exception as e:  # noqa: BLE001 - a kernel's failures come in many types
            return _failure(e)
        if why_not := _differs(got, paged_decode_attention_ref(*args)):
            return why_not
    return ""


def check_native_decode() -> str:
    """The host-built decode kernel (``native_decode``)."""
    try:
        native_decode.load()
    except KernelUnavailable as e:
        return str(e)
    return _check_decode(native_decode.paged_decode_attention_native)


def check_numba_decode() -> str:
    """numba's decode kernel (``cpu_decode``): compiled, or loaded from numba's disk cache."""
    cpu_decode = numba_decode()
    if cpu_decode is None:  # pragma: no cover - numba is a declared dependency
        return "numba cannot be imported"
    return _check_decode(cpu_decode.paged_decode_attention_cpu)


def check_prefill() -> str:
    """The host-built prefill kernel (``cpu_prefill``): GQA, a cached prefix, a decode, partial tiles, several work
    items per sequence."""
    try:
        cpu_prefill.load()
    except KernelUnavailable as e:
        return str(e)
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 64, 16, 2, 32, generator=g).unbind(0)  # [blocks, block_size, kv_heads, dim]
    query_lens, seq_lens = (300, 1, 37), (300, 90, 60)
    tables = torch.randperm(64, generator=g)[: 3 * 19].view(3, 19).to(torch.int32)
    query = torch.randn(sum(query_lens), 4, 32, generator=g)
    start = torch.tensor([0, 300, 301, 338], dtype=torch.int32)
    try:
        got = cpu_prefill.prefill_attention_cpu(query, k_cache, v_cache, tables, query_lens, seq_lens, 0.2)
    except Exception as e:  # noqa: BLE001 - a kernel's failures come in many types
        return _failure(e)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return _differs(got, paged_prefill_attention_ref(query, k_cache, v_cache, tables, start, lens, 0.2, query_lens))


def check_write_kv() -> str:
    """The host-built KV cache write, key and value as strided views of one fused tensor, as the model passes them."""
    try:
        elementwise.load()
    except KernelUnavailable as e:
        return str(e)
    g = torch.Generator().manual_seed(0)
    caches = torch.zeros(2, 2, 160, 16, 2, 16)  # [got/want, k/v, blocks, block_size, kv_heads, dim]
    fused = torch.randn(2100, 3 * 2 * 16, generator=g)
    key, value = (fused[:, i * 32 : (i + 1) * 32].view(-1, 2, 16) for i in (1, 2))
    slots = torch.randperm(160 * 16, generator=g)
    try:
        for rows in (3, 2100):  # on the calling thread, then in a parallel region
            elementwise.write_kv(key[:rows], value[:rows], caches[0, 0], caches[0, 1], slots[:rows])
            write_kv_ref(key[:rows], value[:rows], caches[1, 0], caches[1, 1], slots[:rows])
    except Exception as e:  # noqa: BLE001 - a kernel's failures come in many types
        return _failure(e)
    return "" if torch.equal(caches[0], caches[1]) else "the caches it wrote differ from the reference's"
