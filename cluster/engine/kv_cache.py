"""The engine's paged KV cache tensor, laid out by ``cluster.kv_layout.KVLayout``:

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = key, value)

so ``kv[layer, 0]`` is one layer's key cache ``[num_blocks, block_size, kv_heads, head_dim]``
(contiguous, what the attention kernels read) and ``kv[:, :, block_ids]`` gathers whole
blocks across all layers in one indexing op (what KV transfer sends).
A token at position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
import time

import torch

from cluster.dtypes import torch_dtype
from cluster.kv_layout import KVLayout

log = logging.getLogger(__name__)


#: Linux's madvise(2) advice that maps (and zeroes) a range's pages now, as if written (Linux 5.14+; Python 3.11's
#: mmap module does not name it).
MADV_POPULATE_WRITE = 23


def allocate_kv_cache(layout: KVLayout, device: str | torch.device = "cpu", prefault: bool = False) -> torch.Tensor:
    """Zeroed KV pool: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim].

    ``prefault`` (CPU): map every page, on a thread of its own while the engine goes on starting (``prefaulted``
    tells when it is done). Otherwise a block's pages are mapped and zeroed by the kernel the first time the
    engine writes the block, inside a step: on a fresh server that was ~6% of the engine's time at 4 req/s (a
    profile of skewed-64), since the pool hands out never-used blocks first. Pages the engine writes before the
    thread reaches them are mapped by the write, as without it; a kernel without the advice keeps the lazy
    mapping."""
    shape = layout.blocks_shape(layout.num_blocks)
    dtype = torch_dtype(layout.dtype)
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # On the CPU, from an anonymous mapping: the kernel hands out zeroed pages when they are first written, so
    # the pool costs no memset of gigabytes at start (0.75 s for 2 GiB on the CI machine). Page-aligned, which is
    # what the kernels want.
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    kv = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    if prefault:
        # The thread holds the mapping too: the range stays mapped until it is done, whatever becomes of the pool.
        thread = threading.Thread(target=_populate, args=(buffer, kv.data_ptr(), nbytes), name="kv-prefault")
        thread.daemon = True
        thread.start()
        _prefault_threads[kv.data_ptr()] = thread
    return kv


#: The prefault thread of each pool still being mapped, by the pool's address.
_prefault_threads: dict[int, threading.Thread] = {}


def prefaulted(kv: torch.Tensor, timeout_s: float | None = None) -> bool:
    """Waits up to ``timeout_s`` for ``kv``'s prefault thread (None: until done); True once none is running."""
    thread = _prefault_threads.get(kv.data_ptr())
    if thread is None:
        return True
    thread.join(timeout_s)
    if thread.is_alive():
        return False
    _prefault_threads.pop(kv.data_ptr(), None)
    return True


def _populate(mapping: mmap.mmap, address: int, nbytes: int) -> None:
    # Through ctypes, which drops the GIL for the call: the kernel zeroes the pages (~0.3 s per GiB) while the
    # engine's start-up (weights, kernel probes) goes on. Python's mmap.madvise would hold the GIL throughout.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    started = time.perf_counter()
    if libc.madvise(address, nbytes, MADV_POPULATE_WRITE) != 0:  # EINVAL before Linux 5.14; ENOMEM: no memory now
        log.info("KV pool pages are mapped on first use (%s)", os.strerror(ctypes.get_errno()))
        return
    log.info("KV pool mapped: %.1f GiB in %.2f s", nbytes / 2**30, time.perf_counter() - started)
