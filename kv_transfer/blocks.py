"""Where transferred blocks come from and go to.

``PagedKV`` wraps one paged KV tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``
and moves whole blocks with one indexing op each way (``index_select`` / ``index_copy_`` on the
block dim), never token by token. It is the receiver's ``BlockSink`` and the sender's ``BlockSource``.

Blocks are owned by the worker's own pool, never by kv_transfer. On the receiving side the caller
reserves the destination blocks itself and opens a lease on them (``KVReceiver.open_lease``);
kv_transfer only writes into them while the lease is active and frees nothing. On the sending side
``KVSender`` holds the source blocks for one send and then calls the caller's ``Release``
``(request_id, block_ids)`` exactly once, on a kv_transfer thread: it must take the lock that
guards its pool/engine, e.g. for a prefill ``LLMEngine`` that kept the prompt's KV
(``hold_kv_on_finish=True``)::

    def release(request_id, block_ids):
        with engine_lock:
            engine.release_kv(request_id)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from cluster.dtypes import dtype_name
from cluster.kv_layout import KVLayout
from kv_transfer.lease import LeaseTable


class BlockSource(Protocol):
    layout: KVLayout
    device: torch.device

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks ``[L, 2, n, block_size, H, D]`` as a contiguous tensor (written into ``out`` when given,
        a reused buffer: fresh pages cost more than the copy). Does not modify the cache."""


class BlockSink(Protocol):
    layout: KVLayout
    device: torch.device

    def scatter(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Writes ``blocks`` ``[L, 2, n, block_size, H, D]`` into ``block_ids`` (whole blocks)."""


class PagedKV:
    """A ``BlockSource`` and ``BlockSink`` over one paged KV tensor."""

    def __init__(self, kv: torch.Tensor):
        if kv.dim() != 6 or kv.shape[1] != 2:
            raise ValueError(f"expected a KV tensor [L, 2, num_blocks, block_size, H, D], got shape {list(kv.shape)}")
        self.kv = kv
        num_layers, _, num_blocks, block_size, kv_heads, head_dim = kv.shape
        self.layout = KVLayout(num_layers, kv_heads, head_dim, block_size, dtype_name(kv.dtype), num_blocks)
        self.device = kv.device

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.layout.num_blocks):
            raise ValueError(f"block ids {list(block_ids)} out of range [0, {self.layout.num_blocks})")
        return ids.to(self.device)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return self.kv.index_select(2, self._index(block_ids))
        if out.device != self.kv.device:  # e.g. a CUDA pool sent over gloo
            return out.copy_(self.kv.index_select(2, self._index(block_ids)))
        return torch.index_select(self.kv, 2, self._index(block_ids), out=out)

    def scatter(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        want = blocks_shape(self.layout, len(block_ids))
        if tuple(blocks.shape) != want or blocks.dtype != self.kv.dtype:
            raise ValueError(
                f"blocks of shape {list(blocks.shape)} {blocks.dtype} do not fit {len(block_ids)} blocks "
                f"of this cache: want {list(want)} {self.kv.dtype}"
            )
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"duplicate destination block ids {list(block_ids)}")
        self.kv.index_copy_(2, self._index(block_ids), blocks.to(self.device))


def blocks_shape(layout: KVLayout, n: int) -> tuple[int, ...]:
    """Shape of ``n`` whole blocks across all layers: ``[L, 2, n, block_size, H, D]``."""
    return layout.blocks_shape(n)


#: Sender-side release of the source blocks of one send: ``release(request_id, block_ids)``.
Release = Callable[[str, Sequence[int]], None]


class LeasedBlocks:
    """The sender's source blocks of one lease, read only while that lease is active: a gather holds the
    lease's guard, so the blocks cannot be released (the lease ended) in the middle of it."""

    def __init__(self, source: BlockSource, block_ids: Sequence[int], leases: LeaseTable, lease_id: str):
        self.source = source
        self.block_ids = tuple(block_ids)
        self.leases = leases
        self.lease_id = lease_id

    def gather(self, start: int, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Lease positions ``start .. start+n`` as ``[L, 2, n, bs, H, D]`` (into ``out`` if given). Raises
        LeaseEndedError if the lease has ended. Does not modify the cache."""
        with self.leases.guard(self.lease_id):
            return self.source.gather(self.block_ids[start : start + n], out)
