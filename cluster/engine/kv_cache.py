"""The engine's paged KV cache tensor, laid out by ``cluster.kv_layout.KVLayout``:

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = key, value)

so ``kv[layer, 0]`` is one layer's key cache ``[num_blocks, block_size, kv_heads, head_dim]``
(contiguous, what the attention kernels read) and ``kv[:, :, block_ids]`` gathers whole
blocks across all layers in one indexing op (what KV transfer sends).
A token at position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import math
import mmap

import torch

from cluster.dtypes import torch_dtype
from cluster.kv_layout import KVLayout


def allocate_kv_cache(layout: KVLayout, device: str | torch.device = "cpu") -> torch.Tensor:
    """Zeroed KV pool, its memory committed: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
    shape = layout.blocks_shape(layout.num_blocks)
    dtype = torch_dtype(layout.dtype)
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # On the CPU, from an anonymous mapping: page-aligned (what the kernels want), and zeroed by the kernel as
    # each page is first written, with no memset of gigabytes beside that.
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pool = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)
    _fault_in(pool)
    return pool.view(dtype).view(shape)


def _fault_in(pool: torch.Tensor) -> None:
    """Writes one byte of every page of a fresh, all-zero ``pool`` (on torch's threads), so the pages are backed
    now rather than by the first steps that use their blocks.

    A first write to a page traps into the kernel (and, in a VM, often into the host) to back it: on the 2-core
    bench VM about 4 us a page, which put 37 ms of page faults into a 1536-token prefill step's KV writes (1 ms
    once the pages were backed), 7% of the step, paid by every prompt until the pool's every block had been used
    once. Faulting the pool in at start costs 0.2-1.5 s per GiB there, like the ``torch.zeros`` of vLLM's and
    SGLang's pools; it also makes a pool too large for the machine fail at start instead of under load."""
    page = mmap.PAGESIZE
    pool[::page].zero_()  # every page's first byte: the pool is all zeros, so no content changes
