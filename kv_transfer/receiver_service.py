"""The receiver's gRPC service: what a ``KVSender`` talks to. ``KVReceiver.start()`` starts it.

Methods of ``shapeserve.kv.KVTransfer`` (see ``rpc.py``), each a thin handler over the receiver:

- ``Handshake``: layout check (both sides), the transports offered, the TCPStore for collectives;
- ``JoinGroup``: builds the receiver's rank of a two-rank gloo/NCCL group with one sender;
- ``PushBlocks`` (grpc data plane) / ``PushCollective`` (gloo, nccl): blocks into a lease, through
  the receiver's guarded ``write``;
- ``CompleteLease``: the sender sent every block -> ``KVReceiver.complete``;
- ``AbortLease``: the sender gave up -> ``KVReceiver.abort``.

Leases are opened only by the receiver's owner (``KVReceiver.open_lease``); nothing here opens
one. Collective groups are kept per pair, at most ``config.max_peer_groups`` of them (the least
recently used is closed), and a sender's rejoin replaces its old group.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import grpc
import torch.distributed as dist

from kv_transfer import collective, rpc, wire
from kv_transfer.errors import LayoutMismatchError, StaleGroupError, TransportError
from kv_transfer.transports import TRANSPORTS, CollectiveTransport, GrpcTransport, supported_transports

if TYPE_CHECKING:
    from kv_transfer.receiver import KVReceiver

log = logging.getLogger(__name__)


class ReceiverService:
    def __init__(self, receiver: KVReceiver):
        self.receiver = receiver
        self.config = receiver.config
        self.transports = supported_transports(receiver.device)
        self.address = ""
        self._server: grpc.Server | None = None
        self._store: dist.Store | None = None
        self._store_addr = ""
        #: Collective groups by pair id, least recently used first (senders that died idle age out).
        self._groups: OrderedDict[str, collective.PairGroup] = OrderedDict()
        self._group_by_sender: dict[tuple[str, str], str] = {}
        self._groups_lock = threading.Lock()

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> ReceiverService:
        """Opens the TCPStore (if a collective transport is available) and starts serving. Idempotent."""
        if self._server is not None:
            return self
        cfg = self.config
        if any(t != "grpc" for t in self.transports):
            try:
                self._store = collective.open_store(cfg.host, 0, is_master=True, timeout_s=cfg.connect_timeout_s)
                self._store_addr = f"{cfg.public_host}:{self._store.port}"
            except Exception as e:  # collectives are an optimization; grpc still works
                log.warning("no TCPStore for collective transports (%s); offering grpc only", e)
                self.transports = ("grpc",)
        self._server, port = rpc.start_server(
            cfg.host,
            cfg.port,
            unary={
                "Handshake": self._handshake,
                "JoinGroup": self._join_group,
                "PushCollective": self._push_collective,
                "CompleteLease": self._complete,
                "AbortLease": self._abort,
            },
            streams={"PushBlocks": self._push_blocks},
            threads=cfg.server_threads,
            max_message_bytes=rpc.max_message_bytes(cfg, self.receiver.layout.bytes_per_block),
        )
        self.address = f"{cfg.public_host}:{port}"
        return self

    def close(self) -> None:
        """Stops serving and closes every collective group. Idempotent."""
        if self._server is not None:
            self._server.stop(grace=0.5).wait(2)
            self._server = None
        with self._groups_lock:
            for group in self._groups.values():
                group.close()
            self._groups.clear()
            self._group_by_sender.clear()
        self._store = None

    @property
    def num_groups(self) -> int:
        with self._groups_lock:
            return len(self._groups)

    # ---- handlers ----------------------------------------------------------------------

    def _handshake(self, raw: bytes) -> wire.HandshakeReply:
        msg = wire.decode(raw, wire.Handshake)
        r = self.receiver
        problem = r.layout.mismatch(msg.layout)
        if problem:
            r.metrics.record_failure("all", "LayoutMismatchError")
            raise LayoutMismatchError(f"receiver {r.receiver_id} refuses sender {msg.sender_id}: {problem}")
        return wire.HandshakeReply(r.receiver_id, r.layout, self.transports, self._store_addr)

    def _join_group(self, raw: bytes) -> wire.JoinGroupReply:
        msg = wire.decode(raw, wire.JoinGroup)
        if msg.backend not in self.transports or not issubclass(TRANSPORTS[msg.backend], CollectiveTransport):
            raise TransportError(
                f"receiver {self.receiver.receiver_id} does not offer {msg.backend!r} (offers {list(self.transports)})"
            )
        cfg = self.config
        if self._store is None:  # not offered without a store; a sender asking anyway gets a clear error
            raise TransportError(f"receiver {self.receiver.receiver_id} has no store for collective transports")
        group = collective.make_group(
            msg.pair_id,
            msg.backend,
            self._store,
            collective.RECEIVER_RANK,
            self.receiver.device,
            cfg.collective_timeout_s,
            cfg.connect_timeout_s,
        )
        with self._groups_lock:
            old = self._group_by_sender.get((msg.sender_id, msg.backend))
            if old is not None and old in self._groups:
                self._groups.pop(old).close()  # a sender only rejoins after its group broke
            self._groups[msg.pair_id] = group
            self._group_by_sender[(msg.sender_id, msg.backend)] = msg.pair_id
            while len(self._groups) > cfg.max_peer_groups:
                _, oldest = self._groups.popitem(last=False)
                oldest.close()
            self._group_by_sender = {k: v for k, v in self._group_by_sender.items() if v in self._groups}
        return wire.JoinGroupReply(msg.pair_id)

    def _push_blocks(self, requests, context: grpc.ServicerContext) -> wire.PushReply:
        return GrpcTransport.receive_blocks(self.receiver, requests, context)

    def _push_collective(self, raw: bytes) -> wire.PushReply:
        msg = wire.decode(raw, wire.CollectivePush)
        with self._groups_lock:
            group = self._groups.get(msg.pair_id)
            if group is not None:
                self._groups.move_to_end(msg.pair_id)
        if group is None or group.broken:  # nothing was received: the sender may rejoin and retry
            raise StaleGroupError(f"collective group {msg.pair_id} is unknown or broken here; rejoin")
        entry = self.receiver.leases.get(msg.lease_id)
        deadline = entry.deadline if entry else time.monotonic()
        try:
            return CollectiveTransport.receive_blocks(self.receiver, msg, group, deadline)
        except Exception:
            group.close()  # the sender's ops are now unmatched: the group cannot be reused
            raise
        finally:
            if group.broken:
                with self._groups_lock:
                    if self._groups.get(msg.pair_id) is group:
                        self._groups.pop(msg.pair_id)
                        self._group_by_sender = {k: v for k, v in self._group_by_sender.items() if v != msg.pair_id}

    def _complete(self, raw: bytes) -> wire.LeaseStatus:
        msg = wire.decode(raw, wire.CompleteLease)
        out = self.receiver.complete(msg.lease_id)
        return wire.LeaseStatus(out.lease_id, out.state.name, out.reason)

    def _abort(self, raw: bytes) -> wire.LeaseStatus:
        msg = wire.decode(raw, wire.AbortLease)
        self.receiver.abort(msg.lease_id, f"aborted by the sender: {msg.reason}")
        out = self.receiver.outcome(msg.lease_id)
        if out is None:
            return wire.LeaseStatus(msg.lease_id, "UNKNOWN", "")
        return wire.LeaseStatus(msg.lease_id, out.state.name, out.reason)
