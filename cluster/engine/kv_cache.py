"""The engine's paged KV cache tensor, laid out by ``cluster.kv_layout.KVLayout``:

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = key, value)

so ``kv[layer, 0]`` is one layer's key cache ``[num_blocks, block_size, kv_heads, head_dim]``
(contiguous, what the attention kernels read) and ``kv[:, :, block_ids]`` gathers whole
blocks across all layers in one indexing op (what KV transfer sends).
A token at position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

On the CPU the pool's pages are backed ahead of the steps that use them. A first write to a page traps into
the kernel (and, in a VM, often into the host) to back it: on the 2-core bench VM about 4 us a page, which put
37 ms of page faults into a 1536-token prefill step's KV writes (1 ms once the pages were backed), 7% of the
step, paid by every prompt until each block had been used once. vLLM's and SGLang's pools pay for this at start
(``torch.zeros``), which on that VM costs 0.3-1.5 s per GiB of start-up; here a background thread backs the pages
while the engine already serves (see ``allocate_kv_cache``).
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import sys
import threading
from collections.abc import Callable

import torch

from cluster.dtypes import torch_dtype
from cluster.kv_layout import KVLayout

#: Linux's madvise advice (5.14+) that backs a range's pages, writable, leaving their content as it is.
_MADV_POPULATE_WRITE = 23
#: Blocks backed per madvise call and per region (layer x key/value), in the order the block pool hands out
#: never-used blocks, so the blocks the first requests get are backed first.
_BLOCKS_PER_CALL = 64


def allocate_kv_cache(
    layout: KVLayout, device: str | torch.device = "cpu", *, wait_until_backed: bool = True
) -> torch.Tensor:
    """A zeroed pool: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim].

    On the CPU it comes from an anonymous mapping (page-aligned, what the kernels want, and zeroed by the kernel
    as each page is backed, with no memset of gigabytes beside that). ``wait_until_backed=False`` returns it at
    once and backs its pages on a background thread, which is safe while the pool is in use: madvise's
    MADV_POPULATE_WRITE backs a page and leaves its content as it is, and does nothing to a page already backed.
    Where the kernel or the OS has no such advice, one write per page backs the pool before it is returned.
    """
    shape = layout.blocks_shape(layout.num_blocks)
    dtype = torch_dtype(layout.dtype)
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
    pool = mapping.view(dtype).view(shape)
    if nbytes == 0:
        return pool
    if not _populate_writable(mapping.data_ptr(), mmap.PAGESIZE):
        # An older kernel or another OS: write one zero per page (on torch's threads) while nobody holds the pool.
        mapping[:: mmap.PAGESIZE].zero_()
        return pool
    regions = mapping.view(math.prod(shape[:2]), layout.num_blocks, -1)  # [layers x 2, blocks, block bytes]
    backer = threading.Thread(target=_back_in_block_order, args=(regions,), name="kv-cache-backer", daemon=True)
    backer.start()
    if wait_until_backed:
        backer.join()
    return pool


def _back_in_block_order(regions: torch.Tensor) -> None:
    """Backs every page of ``regions`` ([regions, blocks, bytes per block], one mapping, which this thread's
    reference keeps alive), the first blocks of every region first."""
    num_regions, num_blocks, block_bytes = regions.shape
    base, end = regions.data_ptr(), regions.data_ptr() + regions.numel()
    page = mmap.PAGESIZE
    for first in range(0, num_blocks, _BLOCKS_PER_CALL):
        count = min(_BLOCKS_PER_CALL, num_blocks - first)
        for region in range(num_regions):
            # madvise wants page-aligned ranges; blocks need not be whole pages, and the mapping is whole pages.
            start = regions[region, first].data_ptr()
            aligned = base + (start - base) // page * page
            stop = min(start + count * block_bytes, end)
            _populate_writable(aligned, -(-(stop - aligned) // page) * page)


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def _populate_writable(address: int, nbytes: int) -> bool:
    """Backs ``nbytes`` of memory at ``address`` (page-aligned) with madvise(MADV_POPULATE_WRITE): in the
    kernel, without holding the GIL (ctypes releases it). False where the kernel or the OS has no such advice."""
    madvise = _madvise()
    return madvise is not None and madvise(address, nbytes, _MADV_POPULATE_WRITE) == 0
