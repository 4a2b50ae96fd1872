"""The engine's paged KV cache tensor, laid out by ``cluster.kv_layout.KVLayout``:

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = key, value)

so ``kv[layer, 0]`` is one layer's key cache ``[num_blocks, block_size, kv_heads, head_dim]``
(contiguous, what the attention kernels read) and ``kv[:, :, block_ids]`` gathers whole
blocks across all layers in one indexing op (what KV transfer sends).
A token at position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import torch

from cluster.dtypes import torch_dtype
from cluster.kv_layout import KVLayout


def allocate_kv_cache(layout: KVLayout, device: str | torch.device = "cpu") -> torch.Tensor:
    """Zeroed KV pool: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
    return torch.zeros(layout.blocks_shape(layout.num_blocks), dtype=torch_dtype(layout.dtype), device=device)
