"""Paged KV block pool with automatic prefix caching.

Every block is in exactly one state:
  - free:   ref_count 0, no hash             (in the reusable queue)
  - cached: ref_count 0, hash of its tokens  (in the reusable queue, and findable by hash)
  - used:   ref_count > 0                     (owned by one or more requests)

One reusable queue holds free and cached blocks in LRU order: allocation takes from its
head (never-used blocks first, then the least recently freed), evicting a cached block's
hash when it is reused. A request frees its blocks tail first, so a prefix's last blocks
are evicted before its first ones (a shorter prefix stays useful longer).

Hashes (``cluster.prefix_hash``) are chained over full blocks only and stable across
processes, so a router can score prefix affinity with the same function a worker uses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cluster.prefix_hash import BlockHash


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Reusable blocks (ref_count 0), oldest first. OrderedDict gives O(1) removal from the middle.
        self._reusable: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[BlockHash, int] = {}
        self.num_cache_queries = 0
        self.num_cache_hits = 0
        self.num_evictions = 0

    # ---- queries (do not modify the pool) ---------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached ones."""
        return len(self._reusable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._reusable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash, used or not."""
        return len(self._by_hash)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest cached run of ``block_hashes`` from the start. Does not modify the pool."""
        found: list[int] = []
        if not self.enable_prefix_caching:
            return found
        for h in block_hashes:
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    # ---- state changes -----------------------------------------------------------------

    def allocate(self, n: int) -> list[int] | None:
        """Takes ``n`` blocks with ref_count 1, evicting LRU cached blocks if needed; None if fewer are reusable."""
        if n > len(self._reusable):
            return None
        ids: list[int] = []
        for _ in range(n):
            block_id, _ = self._reusable.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._by_hash[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def acquire_cached(self, block_ids: Iterable[int]) -> None:
        """Adds a reference to blocks found by ``lookup_prefix`` (a prefix-cache hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._reusable[block_id]
            block.ref_count += 1

    def record_prefix_query(self, num_queried_blocks: int, num_hit_blocks: int) -> None:
        self.num_cache_queries += num_queried_blocks
        self.num_cache_hits += num_hit_blocks

    def release(self, block_ids: Sequence[int]) -> None:
        """Drops one reference from each block, tail first. Blocks reaching 0 become reusable."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} released more often than acquired")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None and not self.enable_prefix_caching:
                    block.block_hash = None
                self._reusable[block_id] = None

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> None:
        """Registers hashes for newly full blocks (same length lists). A hash already cached elsewhere
        keeps its first block: the duplicate stays unhashed and is freed normally."""
        if not self.enable_prefix_caching:
            return
        for block_id, h in zip(block_ids, block_hashes, strict=False):
            block = self.blocks[block_id]
            if block.block_hash is not None or h in self._by_hash:
                continue
            block.block_hash = h
            self._by_hash[h] = block_id

    def check_integrity(self) -> None:
        """free + cached + used == total, and every index agrees with the blocks. Raises AssertionError."""
        used = [b for b in self.blocks if b.ref_count > 0]
        reusable = [b for b in self.blocks if b.ref_count == 0]
        assert all(b.ref_count >= 0 for b in self.blocks), "negative ref count"
        assert len(used) + len(reusable) == self.num_blocks
        assert set(self._reusable) == {b.block_id for b in reusable}, "reusable queue out of sync"
        hashed = {b.block_hash: b.block_id for b in self.blocks if b.block_hash is not None}
        assert hashed == self._by_hash, "hash index out of sync"
