"""The ``torch`` attention backend, the CPU default: no per-request loops.

For float32 KV on a CPU, each part of a step goes to the fastest kernel that checks out against the
torch reference (``cpu_kernel_checks``, once per backend, at ``warm_up``); the log says once why a
kernel was passed over:

- decodes: the host-built kernel (``native_decode``), else numba's (``cpu_decode``), else SDPA;
- prefill chunks: the host-built kernel (``cpu_prefill``), else SDPA over length buckets (``sdpa``);
- the KV write: the host-built copy (``cluster.engine.native.elementwise``), else ``index_copy_``.

Other dtypes and devices run SDPA and ``index_copy_``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from cluster.engine.attention import cpu_kernel_checks as checks
from cluster.engine.attention import cpu_prefill, native_decode
from cluster.engine.attention.base import AttentionMetadata, write_kv_ref
from cluster.engine.attention.sdpa import GatherBuffer, paged_attention_sdpa
from cluster.engine.native import elementwise

log = logging.getLogger(__name__)

#: The kernels a backend may check, by the name its log and ``checked`` use.
NATIVE_DECODE = "host-built decode kernel"
NUMBA_DECODE = "numba decode kernel"
NATIVE_PREFILL = "host-built prefill attention kernel"
NATIVE_WRITE = "host-built KV cache write"

Decode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


class TorchAttentionBackend:
    """The CPU default: host-built, numba or torch code per part of a step, as the module says."""

    name = "torch"

    def __init__(self) -> None:
        self._gather_buffer = GatherBuffer()
        #: Kernel name -> whether it checked out; a kernel is checked the first time it could be used.
        self.checked: dict[str, bool] = {}

    def _usable(self, kernel: str, check: Callable[[], str], instead: str) -> bool:
        ok = self.checked.get(kernel)
        if ok is None:
            why_not = check()
            if why_not:
                log.warning("the %s is unavailable (%s); %s", kernel, why_not, instead)
            ok = self.checked[kernel] = not why_not
        return ok

    def warm_up(self, k_cache, v_cache) -> None:
        # numba's decode kernel takes ~7 s to compile the first time (then ~0.3 s from its disk cache), a host-built
        # kernel ~0.5 s to build (then milliseconds): paid at start-up, where a failure also degrades before any
        # request.
        query = torch.zeros(1, k_cache.shape[2], k_cache.shape[3], dtype=k_cache.dtype, device=k_cache.device)
        self._decode_kernel(query, k_cache, v_cache)
        self._uses_prefill_kernel(query, k_cache, v_cache)
        self._uses_native_write(query, k_cache, v_cache)

    def _decode_kernel(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Decode | None:
        if native_decode.supports(query, k_cache, v_cache) and self._usable(
            NATIVE_DECODE, checks.check_native_decode, "trying numba's"
        ):
            return native_decode.paged_decode_attention_native
        numba = checks.numba_decode()
        if (
            numba is not None
            and numba.supports(query, k_cache)
            and self._usable(NUMBA_DECODE, checks.check_numba_decode, "decodes run through SDPA")
        ):
            return numba.paged_decode_attention_cpu
        return None

    def _uses_prefill_kernel(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        return cpu_prefill.supports(query, k_cache, v_cache) and self._usable(
            NATIVE_PREFILL, checks.check_prefill, "prefills run through SDPA"
        )

    def _uses_native_write(self, key: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        return elementwise.supports_write_kv(key, k_cache, v_cache) and self._usable(
            NATIVE_WRITE, checks.check_write_kv, "it runs as index_copy_"
        )

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if self._uses_native_write(key, k_cache, v_cache) and elementwise.supports_write_kv(value, k_cache, v_cache):
            elementwise.write_kv(key, value, k_cache, v_cache, slot_mapping)
        else:
            write_kv_ref(key, value, k_cache, v_cache, slot_mapping)

    def attend(
        self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, key=None, value=None
    ) -> torch.Tensor:
        decode = self._decode_kernel(query, k_cache, v_cache)
        nd = meta.num_decodes if decode is not None else 0
        if decode is not None and nd == meta.num_seqs:
            return decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        query_lens = meta.query_lens_list or tuple((meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist())
        seq_lens = meta.seq_lens_list or tuple(meta.seq_lens.tolist())
        if self._uses_prefill_kernel(query, k_cache, v_cache):
            # Everything past the decodes (all of it, without a decode kernel) in one call per layer.
            rest = cpu_prefill.prefill_attention_cpu(
                query[nd:], k_cache, v_cache, meta.block_tables[nd:], query_lens[nd:], seq_lens[nd:], scale
            )
        else:
            # The new rows stand in for the cache only where they hold the same values (a cache of another dtype
            # rounds).
            fresh = (
                (key[nd:], value[nd:]) if key is not None and value is not None and key.dtype == k_cache.dtype else None
            )
            rest = paged_attention_sdpa(
                query[nd:],
                k_cache,
                v_cache,
                meta.block_tables[nd:],
                query_lens[nd:],
                seq_lens[nd:],
                scale,
                buffer=self._gather_buffer,
                fresh_kv=fresh,
            )
        if decode is None or nd == 0:
            return rest
        out = torch.empty_like(query)
        out[:nd] = decode(query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale)
        out[nd:] = rest
        return out
