"""The engine's paged KV cache tensor, laid out by ``cluster.kv_layout.KVLayout``:

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = key, value)

so ``kv[layer, 0]`` is one layer's key cache ``[num_blocks, block_size, kv_heads, head_dim]``
(contiguous, what the attention kernels read) and ``kv[:, :, block_ids]`` gathers whole
blocks across all layers in one indexing op (what KV transfer sends).
A token at position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

The pool's memory is backed when it is allocated, not by the steps that first use its blocks. A first write to
a page traps into the kernel (and, in a VM, often into the host) to back it, and the block pool hands out
never-used blocks first, so every prompt paid for its blocks' pages until each block had been used once:
``python -m bench.kv_first_touch`` times a 1536-token prefill step both ways (on the 2-core bench VM the step's KV
writes took several times as long, and the step 5% longer, on pages not yet backed). vLLM's and SGLang's pools pay
for this at start too (``torch.zeros``); here it runs on a thread of its own while the engine loads its weights
(``start_kv_cache``). The two still slow each other: on that VM a 1 GiB pool put about 2 s on the server's time to
/health. Backing the pool while the engine already served instead cost a first burst 15% of its throughput (it
backs the whole pool, several times the pages the burst itself touches), so the engine waits for it.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
import threading

import torch

from cluster.dtypes import torch_dtype
from cluster.kv_layout import KVLayout

#: Linux's madvise advice (5.14+) that backs a range's pages, writable, leaving their content as it is.
_MADV_POPULATE_WRITE = 23


class PendingKVCache:
    """A KV pool whose pages are being backed on a background thread. Nothing may read or write the pool before
    ``result()`` returns it."""

    def __init__(self, pool: torch.Tensor, mapping: torch.Tensor | None = None):
        self._pool = pool
        #: The CPU pool's whole mapping as bytes; None when there is nothing to back (a GPU pool).
        self._mapping = mapping
        self._backed_by_kernel = False
        self._thread: threading.Thread | None = None
        if mapping is not None:
            self._thread = threading.Thread(target=self._populate, name="kv-cache-fault-in", daemon=True)
            self._thread.start()

    def _populate(self) -> None:
        assert self._mapping is not None
        self._backed_by_kernel = _populate_writable(self._mapping.data_ptr(), self._mapping.numel())

    def result(self) -> torch.Tensor:
        """The pool, every page backed. Waits for the background thread."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if not self._backed_by_kernel and self._mapping is not None:
                # An older kernel or another OS: one write per page (on torch's threads) does it, and as the pool
                # is all zeros and nobody holds it yet, writing a zero changes nothing.
                self._mapping[:: mmap.PAGESIZE].zero_()
        return self._pool


def start_kv_cache(layout: KVLayout, device: str | torch.device = "cpu") -> PendingKVCache:
    """Allocates a zeroed pool, [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], and starts backing
    its memory; ``result()`` returns it once backed, so the caller can do other work meanwhile."""
    shape = layout.blocks_shape(layout.num_blocks)
    dtype = torch_dtype(layout.dtype)
    if torch.device(device).type != "cpu":
        return PendingKVCache(torch.zeros(shape, dtype=dtype, device=device))
    # On the CPU, from an anonymous mapping: page-aligned (what the kernels want), and zeroed by the kernel as
    # each page is backed, with no memset of gigabytes beside that.
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
    return PendingKVCache(mapping.view(dtype).view(shape), mapping)


def allocate_kv_cache(layout: KVLayout, device: str | torch.device = "cpu") -> torch.Tensor:
    """A zeroed pool, its memory backed: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
    return start_kv_cache(layout, device).result()


def _populate_writable(address: int, nbytes: int) -> bool:
    """Backs ``nbytes`` of memory at ``address`` with madvise(MADV_POPULATE_WRITE): in the kernel, without
    holding the GIL (ctypes releases it). False where the kernel or the OS has no such advice."""
    if nbytes == 0:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise(address, nbytes, _MADV_POPULATE_WRITE) == 0
