"""The ``torch`` attention backend, the CPU default: no per-request loops.

float32 decodes go to the compiled paged decode kernel (``cpu_decode``, numba) and float32 prefill
chunks to the prefill kernel built for this host (``cpu_prefill``, C++), each where it compiles and
checks out against the reference; everything else goes to fused SDPA over length buckets
(``sdpa``). Each fast path is tried once (at ``warm_up``) and degrades to SDPA, saying so once.
"""

from __future__ import annotations

import logging

import torch

from cluster.engine.attention import cpu_prefill
from cluster.engine.attention.base import (
    AttentionMetadata,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    write_kv_ref,
)
from cluster.engine.attention.sdpa import GatherBuffer, paged_attention_sdpa
from cluster.engine.native import KernelUnavailable, elementwise

log = logging.getLogger(__name__)

try:  # numba compiles the CPU decode kernel; without it, decodes run through SDPA too.
    from cluster.engine.attention import cpu_decode as _cpu_decode

    _CPU_DECODE_UNAVAILABLE = ""
except ImportError as _e:  # pragma: no cover - numba is a declared dependency
    _cpu_decode = None  # type: ignore[assignment]
    _CPU_DECODE_UNAVAILABLE = f"numba cannot be imported ({_e})"


def probe_cpu_decode_kernel() -> str:
    """Compiles the float32 CPU decode kernel (or loads it from numba's disk cache) and checks it against
    the reference on fresh random inputs. Returns "" if it can be used, else why not."""
    if _cpu_decode is None:
        return _CPU_DECODE_UNAVAILABLE
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 4, 16, 2, 32, generator=g).unbind(0)  # [blocks, block_size, kv_heads, dim]
    query = torch.randn(2, 4, 32, generator=g)
    tables = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([20, 9], dtype=torch.int32)
    # Two sequences, then one: the kernel's parallel and serial forms.
    for rows in (slice(0, 2), slice(1, 2)):
        args = (query[rows], k_cache, v_cache, tables[rows], seq_lens[rows], 0.2)
        try:
            got = _cpu_decode.paged_decode_attention_cpu(*args)
        except Exception as e:  # noqa: BLE001 - numba/LLVM failures come in many types
            return f"{type(e).__name__}: {e}"
        want = paged_decode_attention_ref(*args)
        if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
            return f"its output differs from the reference by {float((got - want).abs().max()):.2e}"
    return ""


def probe_cpu_prefill_kernel() -> str:
    """Builds the float32 CPU prefill kernel for this host (or loads it built) and checks it against the
    reference on fresh random inputs: GQA, a cached prefix, a decode, partial tiles, several work items
    per sequence. Returns "" if it can be used, else why not."""
    if not cpu_prefill.enabled_by_env():
        return f"{cpu_prefill.ENABLE_ENV} is off"
    try:
        cpu_prefill.load()
    except cpu_prefill.KernelUnavailable as e:
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
        return f"{type(e).__name__}: {e}"
    want = paged_prefill_attention_ref(
        query, k_cache, v_cache, tables, start, torch.tensor(seq_lens, dtype=torch.int32), 0.2, query_lens
    )
    if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
        return f"its output differs from the reference by {float((got - want).abs().max()):.2e}"
    return ""


def probe_native_write_kv() -> str:
    """Builds the compiled KV cache write for this host (or loads it built) and checks it against
    ``write_kv_ref``, key and value as strided views of one fused tensor, as the model passes them.
    Returns "" if it can be used, else why not."""
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
        return f"{type(e).__name__}: {e}"
    if not torch.equal(caches[0], caches[1]):
        return "the caches it wrote differ from the reference's"
    return ""


class TorchAttentionBackend:
    """The CPU default, with no per-request loops: float32 decodes go to the compiled paged decode
    kernel (``cpu_decode``) where it compiles and checks out, everything else to fused SDPA over
    length buckets (``sdpa_attention``)."""

    name = "torch"

    def __init__(self) -> None:
        self._gather_buffer = GatherBuffer()
        #: None until probed (at warm_up, or at the first float32 CPU decode / prefill).
        self._decode_kernel_ok: bool | None = None
        self._prefill_kernel_ok: bool | None = None
        self._native_write_ok: bool | None = None

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if self._uses_native_write(key, k_cache, v_cache) and elementwise.supports_write_kv(value, k_cache, v_cache):
            elementwise.write_kv(key, value, k_cache, v_cache, slot_mapping)
        else:
            write_kv_ref(key, value, k_cache, v_cache, slot_mapping)

    def _uses_native_write(self, key: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        if not elementwise.supports_write_kv(key, k_cache, v_cache):
            return False
        if self._native_write_ok is None:
            why_not = probe_native_write_kv()
            if why_not:
                log.warning("the compiled KV cache write is unavailable (%s); it runs as index_copy_", why_not)
            self._native_write_ok = not why_not
        return self._native_write_ok

    def warm_up(self, k_cache, v_cache) -> None:
        # Compiling the decode kernel takes ~7 s the first time (then it loads from numba's on-disk
        # cache in ~0.3 s): pay it at start-up, where a failure also degrades to SDPA before any request.
        # Building the prefill kernel takes a few seconds the first time (then it loads from its cache).
        query = torch.zeros(1, k_cache.shape[2], k_cache.shape[3], dtype=k_cache.dtype, device=k_cache.device)
        self._uses_decode_kernel(query, k_cache)
        self._uses_prefill_kernel(query, k_cache, v_cache)
        self._uses_native_write(query, k_cache, v_cache)

    def _uses_decode_kernel(self, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        if _cpu_decode is None or not _cpu_decode.supports(query, k_cache):
            return False
        if self._decode_kernel_ok is None:
            why_not = probe_cpu_decode_kernel()
            if why_not:
                log.warning("the compiled CPU decode kernel is unavailable (%s); decodes run through SDPA", why_not)
            self._decode_kernel_ok = not why_not
        return self._decode_kernel_ok

    def _uses_prefill_kernel(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        if not cpu_prefill.supports(query, k_cache, v_cache):
            return False
        if self._prefill_kernel_ok is None:
            why_not = probe_cpu_prefill_kernel()
            if why_not:
                log.warning("the CPU prefill attention kernel is unavailable (%s); prefills run through SDPA", why_not)
            self._prefill_kernel_ok = not why_not
        return self._prefill_kernel_ok

    def attend(
        self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, key=None, value=None
    ) -> torch.Tensor:
        # The new rows stand in for the cache only where they hold the same values (a cache of another dtype rounds).
        fresh = (key, value) if key is not None and value is not None and key.dtype == k_cache.dtype else None
        query_lens = meta.query_lens_list or tuple((meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist())
        seq_lens = meta.seq_lens_list or tuple(meta.seq_lens.tolist())
        nd = meta.num_decodes if self._uses_decode_kernel(query, k_cache) else 0
        if nd < meta.num_seqs and self._uses_prefill_kernel(query, k_cache, v_cache):
            # Everything past the decodes (all of it, without the decode kernel) in one call per layer.
            rest = cpu_prefill.prefill_attention_cpu(
                query[nd:], k_cache, v_cache, meta.block_tables[nd:], query_lens[nd:], seq_lens[nd:], scale
            )
            if nd == 0:
                return rest
            out = torch.empty_like(query)
            out[:nd] = _cpu_decode.paged_decode_attention_cpu(
                query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale
            )
            out[nd:] = rest
            return out
        if nd == 0:
            return paged_attention_sdpa(
                query,
                k_cache,
                v_cache,
                meta.block_tables,
                query_lens,
                seq_lens,
                scale,
                buffer=self._gather_buffer,
                fresh_kv=fresh,
            )
        out = torch.empty_like(query)
        out[:nd] = _cpu_decode.paged_decode_attention_cpu(
            query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale
        )
        if nd < meta.num_seqs:
            out[nd:] = paged_attention_sdpa(
                query[nd:],
                k_cache,
                v_cache,
                meta.block_tables[nd:],
                query_lens[nd:],
                seq_lens[nd:],
                scale,
                buffer=self._gather_buffer,
                fresh_kv=None if fresh is None else (fresh[0][nd:], fresh[1][nd:]),
            )
        return out
