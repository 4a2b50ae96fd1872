"""The sending side (prefill worker): pushes a request's KV blocks into a receiver's lease.

The decode side reserved the destination blocks and opened the lease (``KVReceiver.open_lease``);
the prefill worker gets the lease with the request, computes the prompt's KV, and sends it::

    def release(request_id, block_ids):           # runs once per send, on a kv_transfer thread
        with lock:                                # the lock held around engine.step()
            engine.release_kv(request_id)

    sender = KVSender(PagedKV(engine.kv_cache), release, KVTransferConfig(transport="auto"))
    engine.add_request(rid, prompt_token_ids, params_for_one_token, hold_kv_on_finish=True)  # step to the token
    result = sender.send(lease, engine.held_kv_blocks(rid)[lease.first_block:])   # or .submit(...)
    #   -> TransferResult, or raises KVTransferError within the lease deadline; released either way
    #   -> then report success and the first token to the decode side in the worker's own result message
    sender.abort(lease)                           # gave up before/while sending; idempotent, tells the receiver

``send`` handshakes once per receiver (layout check on both sides), picks the transport
(config ``auto|nccl|gloo|grpc``), moves the blocks, completes the lease, and releases the
source blocks exactly once - on success, failure, abort or expiry alike. It blocks until done,
bounded by the lease deadline; run it from a worker thread (``submit``) to overlap transfers.
The KV protocol carries blocks only: the first token travels in the caller's own messages.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass

import torch

from kv_transfer import rpc, wire
from kv_transfer.blocks import BlockSource, LeasedBlocks, Release
from kv_transfer.config import KVTransferConfig
from kv_transfer.errors import (
    KVTransferError,
    LayoutMismatchError,
    LeaseEndedError,
    PeerUnavailableError,
    TransferTimeoutError,
    TransportError,
)
from kv_transfer.lease import Lease, LeaseState, LeaseTable
from kv_transfer.metrics import TransferMetrics
from kv_transfer.rpc import max_message_bytes
from kv_transfer.transports import TRANSPORTS, Peer, choose_transport, supported_transports

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferResult:
    lease_id: str
    request_id: str
    transport: str
    num_blocks: int
    nbytes: int
    seconds: float


class KVSender:
    def __init__(
        self,
        source: BlockSource,
        release: Release | None = None,
        config: KVTransferConfig | None = None,
        metrics: TransferMetrics | None = None,
    ):
        self.config = (config or KVTransferConfig()).validate()
        self.source = source
        self.layout = source.layout
        self.device = torch.device(source.device)
        self.release = release
        self.metrics = metrics or TransferMetrics()
        self.sender_id = uuid.uuid4().hex[:12]
        self.transports = supported_transports(self.device)
        self.leases = LeaseTable()
        self.leases.start_reaper(self.config.reaper_interval_s)
        self._peers: dict[str, Peer] = {}
        self._peers_lock = threading.Lock()
        self._impls: dict[str, object] = {}
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-send")

    # ---- public API --------------------------------------------------------------------

    def send(self, lease: Lease, src_block_ids: Sequence[int]) -> TransferResult:
        """Moves ``src_block_ids`` (this side) into ``lease.block_ids`` (receiver) and completes the lease.
        Releases the source blocks exactly once whatever happens. Raises KVTransferError within the lease
        deadline on any failure (the receiver's lease is aborted best-effort)."""
        src = tuple(src_block_ids)
        if len(src) != lease.num_blocks:
            raise ValueError(f"lease {lease.lease_id} takes {lease.num_blocks} blocks, got {len(src)} source blocks")
        t0 = time.monotonic()
        ttl = lease.time_left()
        release = self.release
        try:
            self.leases.add(
                lease, max(ttl, 0.0), lambda lz, out: release(lz.request_id, src) if release is not None else None
            )
        except LeaseEndedError:  # closed, or the lease ended before this send began: nothing else releases
            if release is not None:
                release(lease.request_id, src)
            raise
        transport = self.config.transport
        try:
            if ttl <= 0:
                raise LeaseEndedError(f"lease {lease.lease_id} expired {-ttl:.1f}s before the send started")
            deadline = t0 + ttl
            peer = self._peer(lease.receiver_addr)
            transport = choose_transport(self.config.transport, self.transports, peer.hello.transports)
            blocks = LeasedBlocks(self.source, src, self.leases, lease.lease_id)
            nbytes = self._impl(transport).send_blocks(peer, lease, blocks, deadline)
            peer.client.call(
                "CompleteLease",
                wire.CompleteLease(lease.lease_id),
                wire.LeaseStatus,
                min(self.config.rpc_timeout_s, deadline - time.monotonic()),
            )
        except Exception as e:
            err = e if isinstance(e, KVTransferError) else TransportError(f"{type(e).__name__}: {e}")
            self._fail(lease, transport, err)
            if err is e:
                raise
            raise err from e
        self.leases.end(lease.lease_id, LeaseState.COMPLETED)
        seconds = time.monotonic() - t0
        self.metrics.record_transfer(transport, "sent", nbytes, seconds)
        return TransferResult(lease.lease_id, lease.request_id, transport, lease.num_blocks, nbytes, seconds)

    def submit(self, lease: Lease, src_block_ids: Sequence[int]) -> futures.Future:
        """``send`` on a worker thread; the future holds the TransferResult or the KVTransferError."""
        return self._pool.submit(self.send, lease, src_block_ids)

    def abort(self, lease: Lease, reason: str = "aborted by the sender") -> bool:
        """Ends this side's lease (releases source blocks if a send holds them) and tells the receiver,
        best-effort. Idempotent; safe before, during or after ``send``. True if this call ended it here."""
        ended = self.leases.end(lease.lease_id, LeaseState.ABORTED, reason) is not None
        self._tell_abort(lease, reason)
        return ended

    def close(self) -> None:
        """Aborts what is in flight (releasing source blocks), closes channels and groups. Idempotent."""
        self.leases.close("sender shutting down")
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._peers_lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            for group in peer.groups.values():
                group.close()
            peer.client.close()
        for impl in self._impls.values():
            impl.close()  # type: ignore[attr-defined]

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------

    def _fail(self, lease: Lease, transport: str, err: KVTransferError) -> None:
        self.metrics.record_failure(transport, err)
        state = LeaseState.EXPIRED if isinstance(err, TransferTimeoutError) else LeaseState.ABORTED
        self.leases.end(lease.lease_id, state, str(err))
        if isinstance(err, (PeerUnavailableError, TransferTimeoutError, TransportError)):
            self._forget_peer(lease.receiver_addr)
        if not isinstance(err, (LeaseEndedError, PeerUnavailableError)):
            self._tell_abort(lease, str(err))
        log.info("send of lease %s (%s) failed: %s", lease.lease_id, lease.request_id, err)

    def _tell_abort(self, lease: Lease, reason: str) -> None:
        try:
            peer = self._peer(lease.receiver_addr, timeout_s=min(1.0, self.config.rpc_timeout_s))
            peer.client.call(
                "AbortLease",
                wire.AbortLease(lease.lease_id, reason),
                wire.LeaseStatus,
                min(1.0, self.config.rpc_timeout_s),
            )
        except KVTransferError as e:  # the receiver's lease expires on its own
            log.debug("abort of lease %s not delivered: %s", lease.lease_id, e)

    def _impl(self, name: str):
        impl = self._impls.get(name)
        if impl is None:
            impl = self._impls[name] = TRANSPORTS[name](self.config, self.layout, self.device, self.sender_id)
        return impl

    def _peer(self, addr: str, timeout_s: float | None = None) -> Peer:
        """The receiver at ``addr`` after a handshake (cached). Both sides check the layout."""
        with self._peers_lock:
            peer = self._peers.get(addr)
        if peer is not None:
            return peer
        client = rpc.Client(addr, max_message_bytes(self.config, self.layout.bytes_per_block))
        try:
            hello = client.call(
                "Handshake",
                wire.Handshake(self.sender_id, self.layout, self.transports),
                wire.HandshakeReply,
                timeout_s or self.config.rpc_timeout_s,
            )
            problem = self.layout.mismatch(hello.layout)
            if problem:
                raise LayoutMismatchError(f"sender refuses receiver {hello.receiver_id}: {problem}")
        except Exception:
            client.close()
            raise
        peer = Peer(client, hello)
        with self._peers_lock:
            self._peers.setdefault(addr, peer)
            return self._peers[addr]

    def _forget_peer(self, addr: str) -> None:
        with self._peers_lock:
            peer = self._peers.pop(addr, None)
        if peer is not None:
            for group in peer.groups.values():
                group.close()
            peer.client.close()
