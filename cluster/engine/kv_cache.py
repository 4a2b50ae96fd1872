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
    """Zeroed KV pool: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
    shape = layout.blocks_shape(layout.num_blocks)
    dtype = torch_dtype(layout.dtype)
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # On the CPU, from an anonymous mapping: the kernel hands out zeroed pages when they are first written, so
    # the pool costs neither a memset of gigabytes at start (0.75 s for 2 GiB on the CI machine) nor memory
    # for blocks never used. Page-aligned, which is what the kernels want.
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
