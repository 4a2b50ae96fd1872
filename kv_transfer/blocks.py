"""Where transferred blocks come from and go to, and who owns them.

``PagedKV`` wraps one paged KV tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``
and moves whole blocks with one indexing op each way (``index_select`` / ``index_copy_`` on the
block dim), never token by token. ``BlockReserver`` is how a receiver gets destination blocks:
``PoolReserver`` over a bare ``BlockPool`` (tests, tools) or ``EngineReserver`` over an
``LLMEngine`` (decode pool). Sender-side release is a plain callable ``(request_id, block_ids)``.

Reserver and release callbacks run on kv_transfer threads (gRPC handlers, the lease reaper):
each takes the lock that guards its pool/engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cluster.engine.block_pool import BlockPool
from cluster.dtypes import dtype_name
from cluster.kv_layout import KVLayout


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
    return (layout.num_layers, 2, n, layout.block_size, layout.num_kv_heads, layout.head_dim)


# ---- receiver-side reservation ----------------------------------------------------------


@dataclass(frozen=True)
class Reservation:
    #: Destination blocks to fill, in the request's block order.
    block_ids: tuple[int, ...]
    #: Index of ``block_ids[0]`` in the request's block table (earlier blocks are local cache hits).
    first_block: int = 0


class BlockReserver(Protocol):
    def reserve(
        self, request_id: str, num_blocks: int, prompt_token_ids: Sequence[int], context: Any
    ) -> Reservation | None:
        """Takes destination blocks for a request; None if there are not enough free blocks now."""

    def commit(self, request_id: str, block_ids: Sequence[int], first_token_id: int | None) -> None:
        """The transfer completed: the blocks now hold the request's KV and belong to its owner."""

    def free(self, request_id: str, block_ids: Sequence[int]) -> None:
        """The lease was aborted or expired: give the blocks back. Called at most once per lease."""


class PoolReserver:
    """Reserves straight from a ``BlockPool``. After ``commit`` the caller owns the blocks (and releases them)."""

    def __init__(self, pool: BlockPool, lock: threading.Lock | None = None):
        self.pool = pool
        self.lock = lock or threading.Lock()
        self.committed: dict[str, tuple[int, ...]] = {}

    def reserve(
        self, request_id: str, num_blocks: int, prompt_token_ids: Sequence[int], context: Any = None
    ) -> Reservation | None:
        with self.lock:
            ids = self.pool.allocate(num_blocks)
        return None if ids is None else Reservation(tuple(ids))

    def commit(self, request_id: str, block_ids: Sequence[int], first_token_id: int | None) -> None:
        with self.lock:
            self.committed[request_id] = tuple(block_ids)

    def free(self, request_id: str, block_ids: Sequence[int]) -> None:
        with self.lock:
            self.pool.release(block_ids)

    def release_committed(self, request_id: str) -> None:
        """Gives back a completed request's blocks (what the owner does when the request finishes)."""
        with self.lock:
            ids = self.committed.pop(request_id, ())
            self.pool.release(ids)


class EngineReserver:
    """Plugs a decode ``LLMEngine`` in: ``reserve_remote_kv`` / ``complete_remote_kv`` / ``abort_request``.

    ``context`` of ``reserve`` is the request's ``SamplingParams`` (``default_params`` when None, e.g. a
    lease opened remotely). A failed lease calls ``on_failed(request_id)`` - ``engine.abort_request`` by
    default; pass ``engine.fallback_to_local_prefill`` to keep the request and its blocks and prefill
    locally instead. ``lock`` must be the lock the worker holds around ``engine.step()``: these calls
    come from kv_transfer threads.
    """

    def __init__(
        self,
        engine: Any,
        lock: threading.Lock | threading.RLock,
        default_params: Any = None,
        on_failed: Callable[[str], None] | None = None,
    ):
        self.engine = engine
        self.lock = lock
        self.default_params = default_params
        self.on_failed = on_failed or engine.abort_request

    def reserve(
        self, request_id: str, num_blocks: int, prompt_token_ids: Sequence[int], context: Any
    ) -> Reservation | None:
        params = context if context is not None else self.default_params
        if params is None:
            raise ValueError(f"request {request_id}: reserving engine blocks needs the request's SamplingParams")
        with self.lock:
            r = self.engine.reserve_remote_kv(request_id, list(prompt_token_ids), params)
        if r is None:
            return None
        skip = r.num_cached_tokens // self.engine.kv_layout.block_size
        return Reservation(tuple(r.block_ids[skip:]), skip)

    def commit(self, request_id: str, block_ids: Sequence[int], first_token_id: int | None) -> None:
        if first_token_id is None:
            raise ValueError(f"request {request_id}: completing remote KV needs the first token id")
        with self.lock:
            self.engine.complete_remote_kv(request_id, first_token_id)

    def free(self, request_id: str, block_ids: Sequence[int]) -> None:
        with self.lock:
            self.on_failed(request_id)


# ---- sender-side release ----------------------------------------------------------------

Release = Callable[[str, Sequence[int]], None]


def pool_release(pool: BlockPool, lock: threading.Lock) -> Release:
    """Sender-side release over a bare pool: drops the reference the sender held for the transfer."""

    def release(request_id: str, block_ids: Sequence[int]) -> None:
        with lock:
            pool.release(block_ids)

    return release


def engine_release(engine: Any, lock: threading.Lock | threading.RLock) -> Release:
    """Sender-side release for a prefill ``LLMEngine`` that held the blocks (``hold_kv_on_finish=True``)."""

    def release(request_id: str, block_ids: Sequence[int]) -> None:
        with lock:
            engine.release_kv(request_id)

    return release
