"""``KVLayout``: what two workers must agree on before KV blocks move between them.

Shared vocabulary (the engine allocates its cache by it, kv_transfer checks both sides by it);
plain data, no torch. The cache it describes is one tensor per worker:

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = key, value)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from cluster.config import ModelConfig

#: Bytes per element of each KV dtype the engine serves.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    num_blocks: int

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def blocks_shape(self, n: int) -> tuple[int, ...]:
        """Shape of ``n`` whole blocks across all layers: ``[L, 2, n, block_size, H, D]``."""
        return (self.num_layers, 2, n, self.block_size, self.num_kv_heads, self.head_dim)

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
