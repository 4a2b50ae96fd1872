"""``KVLayout``: what two workers must agree on before KV blocks move between them.

Shared vocabulary (the engine allocates its cache by it, kv_transfer checks both sides by it);
plain data, no torch. The cache it describes is one tensor per worker:

    kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (2 = key, value)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from cluster.config import EngineConfig, ModelConfig
from cluster.errors import ConfigError

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


def pool_layout(model: ModelConfig, config: EngineConfig) -> KVLayout:
    """The KV pool an engine built from ``config`` allocates: ``cache.num_blocks`` blocks, else as many as
    ``cache.kv_cache_memory_gb`` holds."""
    cache = config.cache
    num_blocks = cache.num_blocks or num_blocks_for_memory(
        model, cache.block_size, config.dtype, cache.kv_cache_memory_gb
    )
    return KVLayout.for_model(model, cache.block_size, config.dtype, num_blocks)


def check_kv_pools_fit(pools: Mapping[str, tuple[int, KVLayout]], available_bytes: int, lower: str) -> None:
    """ConfigError, naming ``lower`` as what to change, when the KV pools one host will hold (what -> (how many,
    layout)) take more than the memory it has available (0: unknown, no check). On a CPU such a pool failed deep in
    an engine's start (a bare ``OSError: [Errno 12] Cannot allocate memory`` from its mmap), or, just under the
    limit, woke the kernel's OOM killer."""
    needed = sum(count * layout.num_blocks * layout.bytes_per_block for count, layout in pools.values())
    if available_bytes and needed > available_bytes:
        parts = "; ".join(
            f"{what}: {count} x {layout.num_blocks * layout.bytes_per_block / 2**30:.1f} GiB "
            f"({layout.num_blocks} blocks of {layout.block_size} tokens)"
            for what, (count, layout) in pools.items()
        )
        raise ConfigError(
            f"the KV cache takes {needed / 2**30:.1f} GiB ({parts}) but this host has "
            f"{available_bytes / 2**30:.1f} GiB of memory available; lower {lower}"
        )
