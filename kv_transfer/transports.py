"""Data planes, found by name in ``TRANSPORTS``: ``grpc`` (portable), ``gloo`` (CPU), ``nccl`` (CUDA).

A transport only moves bytes; leases, layout checks and completion are the same for all of
them and live in ``KVSender``/``KVReceiver``. Each class is a handful of methods:
``supported(device)``, ``send_blocks`` (sender), ``receive_blocks`` (receiver, called by a
``ReceiverService`` handler; writes through the receiver's guarded ``BlockWriter`` methods),
``close``. Blocks always move as whole-block tensors ``[L, 2, n, bs, H, D]`` gathered from /
scattered into the paged pool with one indexing op per chunk.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import grpc
import torch
import torch.distributed as dist

from cluster.dtypes import torch_dtype
from cluster.kv_layout import KVLayout
from kv_transfer import collective, rpc, wire
from kv_transfer.blocks import LeasedBlocks, blocks_shape
from kv_transfer.config import KVTransferConfig
from kv_transfer.errors import (
    KVTransferError,
    PeerUnavailableError,
    StaleGroupError,
    TransportError,
    WireFormatError,
)
from kv_transfer.lease import Lease

#: Preference of ``auto``: fastest first.
PREFERENCE = ("nccl", "gloo", "grpc")


class BlockWriter(Protocol):
    """The receiver as the transports see it."""

    layout: KVLayout
    device: torch.device

    def lease(self, lease_id: str) -> Lease:
        """The active lease; raises LeaseEndedError. Does not modify anything."""

    def write(self, lease_id: str, start: int, blocks: torch.Tensor) -> None:
        """Validates ``blocks`` against the layout and the lease, then scatters them (under the lease's guard)."""

    def abort(self, lease_id: str, reason: str) -> bool:
        """Idempotent."""

    def ended_reason(self, lease_id: str) -> str | None:
        """Why the lease ended, or None while it is active."""


@dataclass(eq=False)
class Peer:
    """The sender's view of one receiver: channel, handshake answer, collective groups."""

    client: rpc.Client
    hello: wire.HandshakeReply
    groups: dict[str, collective.PairGroup] = field(default_factory=dict)
    store: dist.Store | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def chunks(num_blocks: int, per_chunk: int) -> list[tuple[int, int]]:
    """``(start, count)`` of consecutive chunks covering ``num_blocks`` blocks."""
    return [(s, min(per_chunk, num_blocks - s)) for s in range(0, num_blocks, per_chunk)]


def blocks_per_chunk(layout: KVLayout, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // layout.bytes_per_block)


def _check_chunk(writer: BlockWriter, tensor_shape: tuple[int, ...], dtype: str) -> int:
    """Number of blocks in a chunk of this shape; WireFormatError naming the field that does not fit."""
    lay = writer.layout
    if dtype != lay.dtype:
        raise WireFormatError(f"block chunk dtype is {dtype} but this receiver's KV is {lay.dtype}")
    if len(tensor_shape) != 6:
        raise WireFormatError(f"block chunk has {len(tensor_shape)} dims, want 6 [L, 2, n, block_size, H, D]")
    n = tensor_shape[2]
    want = blocks_shape(lay, n)
    if tuple(tensor_shape) != want:
        names = ("num_layers", "2 (key, value)", "num_blocks", "block_size", "num_kv_heads", "head_dim")
        bad = next(i for i in range(6) if tensor_shape[i] != want[i])
        raise WireFormatError(
            f"block chunk shape {list(tensor_shape)} does not fit this receiver: {names[bad]} is "
            f"{tensor_shape[bad]}, want {want[bad]}"
        )
    return n


class GrpcTransport:
    """Blocks as msgpack ``BlockChunk`` messages of at most ``grpc_chunk_bytes`` on one client stream."""

    name: ClassVar[str] = "grpc"

    def __init__(self, config: KVTransferConfig, layout: KVLayout, device: torch.device, sender_id: str):
        self.layout = layout
        self.per_chunk = blocks_per_chunk(layout, config.grpc_chunk_bytes)

    @staticmethod
    def supported(device: torch.device) -> bool:
        return True

    def send_blocks(self, peer: Peer, lease: Lease, blocks: LeasedBlocks, deadline: float) -> int:
        failure: list[BaseException] = []
        sent = [0]

        plan = chunks(lease.num_blocks, self.per_chunk)
        buf = torch.empty(blocks_shape(self.layout, plan[0][1] if plan else 0), dtype=torch_dtype(self.layout.dtype))

        def messages() -> Iterator[bytes]:
            try:
                for start, n in plan:
                    # The payload views ``buf``; encode() copies it before the next gather reuses it.
                    payload = wire.TensorPayload.from_tensor(
                        blocks.gather(start, n, buf if n == buf.shape[2] else None)
                    )
                    sent[0] += len(payload.data)
                    yield wire.encode(wire.BlockChunk(lease.lease_id, start, payload))
            except BaseException as e:  # grpc would swallow it as CANCELLED; keep the real reason
                failure.append(e)
                raise

        try:
            reply = peer.client.stream("PushBlocks", messages(), wire.PushReply, deadline - time.monotonic())
        except KVTransferError:
            if failure:
                raise failure[0] from None
            raise
        if reply.num_blocks != lease.num_blocks:
            raise TransportError(f"receiver took {reply.num_blocks} of {lease.num_blocks} blocks")
        return sent[0]

    @staticmethod
    def receive_blocks(writer: BlockWriter, requests: Iterator[bytes], context: grpc.ServicerContext) -> wire.PushReply:
        lease_id: str | None = None
        count = 0
        try:
            for raw in requests:
                msg = wire.decode(raw, wire.BlockChunk)
                if lease_id is None:
                    lease_id = msg.lease_id
                elif msg.lease_id != lease_id:
                    raise WireFormatError(
                        f"one PushBlocks stream carries one lease: got {msg.lease_id} after {lease_id}"
                    )
                _check_chunk(writer, msg.blocks.shape, msg.blocks.dtype)
                writer.write(lease_id, msg.start, msg.blocks.to_tensor())
                count += msg.blocks.shape[2]
        except KVTransferError as e:
            if lease_id is not None:
                writer.abort(lease_id, f"rejected block data: {e}")
            raise
        except Exception as e:  # the request stream broke: sender gone or deadline passed
            left = context.time_remaining()
            why = (
                "deadline passed with the sender silent" if left is not None and left <= 0.05 else "sender disconnected"
            )
            if lease_id is not None:
                writer.abort(lease_id, f"block stream broke after {count} blocks: {why}")
            raise PeerUnavailableError(f"block stream broke after {count} blocks: {why} ({type(e).__name__})") from e
        # A sender puts a whole lease on one stream. A short one means it died: gRPC sometimes ends the
        # request iterator quietly when the connection drops, rather than raising.
        expected = writer.lease(lease_id).num_blocks if lease_id is not None else 0
        if lease_id is not None and (count < expected or not context.is_active()):
            reason = f"block stream ended after {count} of {expected} blocks: sender disconnected"
            writer.abort(lease_id, reason)
            raise PeerUnavailableError(reason)
        return wire.PushReply(lease_id or "", count)

    def close(self) -> None:
        pass


class CollectiveTransport:
    """Blocks as tensors over a two-rank torch.distributed group; the gRPC call ``PushCollective``
    tells the receiver what to expect and returns when it has everything."""

    name: ClassVar[str] = ""
    backend: ClassVar[str] = ""

    def __init__(self, config: KVTransferConfig, layout: KVLayout, device: torch.device, sender_id: str):
        self.config = config
        self.layout = layout
        self.device = device
        self.sender_id = sender_id
        self.per_chunk = blocks_per_chunk(layout, config.collective_chunk_bytes)
        self._pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"kv-{self.name}")

    @classmethod
    def supported(cls, device: torch.device) -> bool:
        return collective.backend_available(cls.backend, device)

    # ---- sender side ---------------------------------------------------------------------

    def _group(self, peer: Peer) -> collective.PairGroup:
        with peer.lock:
            group = peer.groups.get(self.backend)
            if group is not None and not group.broken:
                return group
            if not peer.hello.store_addr:
                raise TransportError(f"receiver {peer.client.addr} offers no store for {self.backend} groups")
            cfg = self.config
            if peer.store is None:
                host, _, port = peer.hello.store_addr.rpartition(":")
                peer.store = collective.run_with_deadline(
                    lambda: collective.open_store(host, int(port), is_master=False, timeout_s=cfg.connect_timeout_s),
                    cfg.connect_timeout_s,
                    "connect to the receiver's store",
                )
            pair_id = uuid.uuid4().hex
            mine = self._pool.submit(
                collective.make_group,
                pair_id,
                self.backend,
                peer.store,
                collective.SENDER_RANK,
                self.device,
                cfg.collective_timeout_s,
                cfg.connect_timeout_s,
            )
            try:
                peer.client.call(
                    "JoinGroup",
                    wire.JoinGroup(pair_id, self.backend, self.sender_id),
                    wire.JoinGroupReply,
                    cfg.connect_timeout_s,
                )
                group = mine.result(timeout=cfg.connect_timeout_s)
            except futures.TimeoutError:
                peer.store = None
                raise TransportError(f"{self.backend} group with {peer.client.addr} not ready in time") from None
            except Exception:
                peer.store = None
                raise
            peer.groups[self.backend] = group
            return group

    def send_blocks(self, peer: Peer, lease: Lease, blocks: LeasedBlocks, deadline: float) -> int:
        try:
            return self._send_once(peer, lease, blocks, deadline)
        except StaleGroupError:  # the receiver dropped our group (idle too long, or restarted): rejoin once
            return self._send_once(peer, lease, blocks, deadline)

    def _send_once(self, peer: Peer, lease: Lease, blocks: LeasedBlocks, deadline: float) -> int:
        group = self._group(peer)
        plan = chunks(lease.num_blocks, self.per_chunk)
        dtype = torch_dtype(self.layout.dtype)

        def send_all() -> int:
            nbytes = 0
            for start, n in plan:
                t = blocks.gather(start, n, group.staging(blocks_shape(self.layout, n), dtype))
                group.send(t, deadline - time.monotonic())
                nbytes += t.numel() * t.element_size()
            return nbytes

        with group.exclusive(deadline):
            sending = self._pool.submit(send_all)
            try:
                announce = wire.CollectivePush(lease.lease_id, group.pair_id, tuple(n for _, n in plan))
                reply = peer.client.call("PushCollective", announce, wire.PushReply, deadline - time.monotonic())
                nbytes = sending.result(timeout=max(0.0, deadline - time.monotonic()))
            except futures.TimeoutError:
                group.close()
                raise TransportError(f"{self.backend} send of lease {lease.lease_id} ran past its deadline") from None
            except Exception:
                group.close()
                failure = sending.exception() if sending.done() else None
                if failure is not None and not isinstance(failure, TransportError):
                    raise failure from None  # e.g. LeaseEndedError from our own gather
                raise
        if reply.num_blocks != lease.num_blocks:
            raise TransportError(f"receiver took {reply.num_blocks} of {lease.num_blocks} blocks")
        return nbytes

    # ---- receiver side -------------------------------------------------------------------

    @staticmethod
    def receive_blocks(
        writer: BlockWriter, push: wire.CollectivePush, group: collective.PairGroup, deadline: float
    ) -> wire.PushReply:
        lease = writer.lease(push.lease_id)
        if any(n < 1 for n in push.chunk_blocks) or sum(push.chunk_blocks) != lease.num_blocks:
            raise WireFormatError(
                f"collective push of {list(push.chunk_blocks)} blocks does not cover lease {lease.lease_id} "
                f"({lease.num_blocks} blocks)"
            )
        lay = writer.layout
        dtype = torch_dtype(lay.dtype)
        start = 0
        with group.exclusive(deadline):
            try:
                for n in push.chunk_blocks:
                    staging = group.staging(blocks_shape(lay, n), dtype)
                    group.recv(staging, deadline - time.monotonic(), lambda: writer.ended_reason(lease.lease_id))
                    writer.write(lease.lease_id, start, staging)
                    start += n
            except KVTransferError as e:
                group.close()
                writer.abort(lease.lease_id, f"{group.backend} receive failed after {start} blocks: {e}")
                raise
        return wire.PushReply(lease.lease_id, start)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GlooTransport(CollectiveTransport):
    name = "gloo"
    backend = "gloo"


class NcclTransport(CollectiveTransport):
    name = "nccl"
    backend = "nccl"


TRANSPORTS: dict[str, type[GrpcTransport] | type[CollectiveTransport]] = {
    cls.name: cls for cls in (NcclTransport, GlooTransport, GrpcTransport)
}


def supported_transports(device: torch.device) -> tuple[str, ...]:
    return tuple(name for name in PREFERENCE if TRANSPORTS[name].supported(device))


def choose_transport(wanted: str, mine: tuple[str, ...], theirs: tuple[str, ...]) -> str:
    """``auto``: the first of PREFERENCE both sides support. A named transport must be on both sides."""
    both = [t for t in PREFERENCE if t in mine and t in theirs]
    if wanted == "auto":
        if not both:
            raise TransportError(f"no transport in common: here {list(mine)}, on the receiver {list(theirs)}")
        return both[0]
    if wanted not in both:
        raise TransportError(
            f"transport {wanted!r} is not available on both sides: here {list(mine)}, on the receiver {list(theirs)}"
            + (" (nccl needs CUDA KV tensors on both sides)" if wanted == "nccl" else "")
        )
    return wanted
