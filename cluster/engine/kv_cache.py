"""The paged KV cache tensor and its layout descriptor.

One preallocated tensor per engine:

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = key, value)

so ``kv[layer, 0]`` is one layer's key cache ``[num_blocks, block_size, kv_heads, head_dim]``
(contiguous, what the attention kernels read) and ``kv[:, :, block_ids]`` gathers whole
blocks across all layers in one indexing op (what KV transfer sends).
A token at position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from cluster.config import ModelConfig

_DTYPE_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPE_BY_NAME[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in _DTYPE_BY_NAME.items()}[dtype]


@dataclass(frozen=True)
class KVLayout:
    """Everything two sides must agree on before KV bytes move between them."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    num_blocks: int

    @property
    def bytes_per_block(self) -> int:
        n = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return n * torch.tensor([], dtype=torch_dtype(self.dtype)).element_size()

    def mismatch(self, other: KVLayout, *, ignore_num_blocks: bool = True) -> str | None:
        """Names the first field that differs, or None. Pools may differ in block count."""
        for name, mine in asdict(self).items():
            if ignore_num_blocks and name == "num_blocks":
                continue
            theirs = getattr(other, name)
            if mine != theirs:
                return f"KV layout mismatch: {name} is {mine!r} here but {theirs!r} on the peer"
        return None

    @classmethod
    def for_model(cls, model: ModelConfig, block_size: int, dtype: str, num_blocks: int) -> KVLayout:
        return cls(model.num_layers, model.num_kv_heads, model.head_dim, block_size, dtype, num_blocks)


def num_blocks_for_memory(model: ModelConfig, block_size: int, dtype: str, memory_gb: float) -> int:
    per_block = KVLayout.for_model(model, block_size, dtype, 1).bytes_per_block
    return max(1, int(memory_gb * (1 << 30)) // per_block)


def allocate_kv_cache(layout: KVLayout, device: str | torch.device = "cpu") -> torch.Tensor:
    """Zeroed KV pool: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
    return torch.zeros(
        (layout.num_layers, 2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim),
        dtype=torch_dtype(layout.dtype),
        device=device,
    )
