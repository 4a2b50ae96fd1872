"""The receiving side (decode worker): reserves blocks into leases and serves the gRPC service.

    receiver = KVReceiver(PagedKV(engine.kv_cache), EngineReserver(engine, lock), config).start()
    lease = receiver.open_lease(request_id, prompt_token_ids=ids, context=params)  # None: no blocks now
    ... hand ``lease`` to a prefill worker, which calls KVSender.send(lease, its_block_ids) ...
    outcome = receiver.wait(lease.lease_id, timeout)   # or poll_finished() from the engine loop

A lease ends exactly once here: COMPLETED (the sender's ``CompleteLease`` after every block
arrived -> ``reserver.commit``), or ABORTED / EXPIRED (-> ``reserver.free``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import grpc
import torch

from kv_transfer import collective, rpc, wire
from kv_transfer.blocks import BlockReserver, BlockSink
from kv_transfer.config import KVTransferConfig
from kv_transfer.errors import (
    KVTransferError,
    LayoutMismatchError,
    LeaseEndedError,
    StaleGroupError,
    TransportError,
    WireFormatError,
)
from kv_transfer.lease import Lease, LeaseOutcome, LeaseState, LeaseTable
from kv_transfer.metrics import TransferMetrics
from kv_transfer.transports import TRANSPORTS, CollectiveTransport, GrpcTransport, supported_transports

log = logging.getLogger(__name__)


class KVReceiver:
    def __init__(
        self,
        sink: BlockSink,
        reserver: BlockReserver,
        config: KVTransferConfig | None = None,
        metrics: TransferMetrics | None = None,
    ):
        self.config = (config or KVTransferConfig()).validate()
        self.sink = sink
        self.layout = sink.layout
        self.device = torch.device(sink.device)
        self.reserver = reserver
        self.metrics = metrics or TransferMetrics()
        self.receiver_id = uuid.uuid4().hex[:12]
        self.transports = supported_transports(self.device)
        self.leases = LeaseTable()
        self.address = ""
        self._server: grpc.Server | None = None
        self._store = None
        self._store_addr = ""
        #: Collective groups by pair id, least recently used first (senders that died idle age out).
        self._groups: OrderedDict[str, collective.PairGroup] = OrderedDict()
        self._group_by_sender: dict[tuple[str, str], str] = {}
        self._groups_lock = threading.Lock()
        self._started: dict[str, float] = {}

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> KVReceiver:
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
                "OpenLease": self._open_lease_rpc,
                "JoinGroup": self._join_group,
                "PushCollective": self._push_collective,
                "CompleteLease": self._complete_rpc,
                "AbortLease": self._abort_rpc,
            },
            streams={"PushBlocks": lambda requests, context: GrpcTransport.receive_blocks(self, requests, context)},
            threads=cfg.server_threads,
            max_message_bytes=max_message_bytes(self.config, self.layout.bytes_per_block),
        )
        self.address = f"{cfg.public_host}:{port}"
        self.leases.start_reaper(cfg.reaper_interval_s)
        return self

    def close(self) -> None:
        """Stops serving; aborts open leases (their blocks are freed). Idempotent."""
        if self._server is not None:
            self._server.stop(grace=0.5).wait(2)
            self._server = None
        self.leases.close("receiver shutting down")
        with self._groups_lock:
            for group in self._groups.values():
                group.close()
            self._groups.clear()
        self._store = None

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- leases (the decode worker calls these) ----------------------------------------

    def open_lease(
        self,
        request_id: str,
        *,
        num_blocks: int | None = None,
        prompt_token_ids: Sequence[int] = (),
        ttl_s: float | None = None,
        context: Any = None,
    ) -> Lease | None:
        """Reserves destination blocks (through the reserver) and returns the lease; None if no blocks now.
        ``num_blocks`` defaults to the blocks covering ``prompt_token_ids``; ``context`` goes to the reserver."""
        if num_blocks is None:
            num_blocks = math.ceil(len(prompt_token_ids) / self.layout.block_size)
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        reservation = self.reserver.reserve(request_id, num_blocks, prompt_token_ids, context)
        if reservation is None:
            return None
        ttl = self.config.lease_ttl_s if ttl_s is None else ttl_s
        lease = Lease(
            lease_id=uuid.uuid4().hex,
            request_id=request_id,
            block_ids=tuple(reservation.block_ids),
            first_block=reservation.first_block,
            deadline=time.time() + ttl,
            receiver_addr=self.address,
            receiver_id=self.receiver_id,
        )
        self._started[lease.lease_id] = time.monotonic()
        self.leases.add(lease, ttl, self._on_end)
        return lease

    def _on_end(self, lease: Lease, outcome: LeaseOutcome) -> None:
        started = self._started.pop(lease.lease_id, None)
        if outcome.state == LeaseState.COMPLETED:  # ``complete`` committed the blocks already
            nbytes = lease.num_blocks * self.layout.bytes_per_block
            self.metrics.record_transfer("all", "received", nbytes, time.monotonic() - (started or time.monotonic()))
        else:
            self.reserver.free(lease.request_id, lease.block_ids)
            self.metrics.add(f"leases_{outcome.state.name.lower()}", "all")
            log.info("lease %s (%s) %s: %s", lease.lease_id, lease.request_id, outcome.state.name, outcome.reason)

    def abort(self, lease_id: str, reason: str = "aborted by the receiver") -> bool:
        """Ends the lease and frees its blocks. Idempotent; False if it had already ended."""
        return self.leases.end(lease_id, LeaseState.ABORTED, reason) is not None

    def wait(self, lease_id: str, timeout: float) -> LeaseOutcome:
        """Blocks until the lease ends (outcome.ok tells how); TransferTimeoutError after ``timeout``."""
        return self.leases.wait(lease_id, timeout)

    def poll_finished(self) -> list[LeaseOutcome]:
        """Leases that ended since the last call; never blocks."""
        return self.leases.poll_finished()

    def num_received(self, lease_id: str) -> int:
        entry = self.leases.get(lease_id)
        return entry.num_received if entry else 0

    # ---- BlockWriter (the transports call these) ---------------------------------------

    def lease(self, lease_id: str) -> Lease:
        entry = self.leases.get(lease_id)
        if entry is None:
            raise self.leases.ended_error(lease_id)
        return entry.lease

    def ended_reason(self, lease_id: str) -> str | None:
        entry = self.leases.get(lease_id)
        if entry is not None and not entry.state.is_ended:
            return None
        out = self.leases.outcome(lease_id)
        return f"lease {lease_id} {out.state.name.lower()}: {out.reason}" if out else f"lease {lease_id} ended"

    def write(self, lease_id: str, start: int, blocks: torch.Tensor) -> None:
        n = blocks.shape[2]
        with self.leases.guard(lease_id) as entry:
            if start < 0 or start + n > entry.lease.num_blocks:
                raise WireFormatError(
                    f"blocks {start}..{start + n} are outside lease {lease_id} of {entry.lease.num_blocks} blocks"
                )
            self.sink.scatter(entry.lease.block_ids[start : start + n], blocks)
            entry.mark_received(start, n)

    # ---- gRPC handlers -----------------------------------------------------------------

    def _handshake(self, raw: bytes) -> wire.HandshakeReply:
        msg = wire.decode(raw, wire.Handshake)
        problem = self.layout.mismatch(msg.layout)
        if problem:
            self.metrics.record_failure("all", "LayoutMismatchError")
            raise LayoutMismatchError(f"receiver {self.receiver_id} refuses sender {msg.sender_id}: {problem}")
        return wire.HandshakeReply(self.receiver_id, self.layout, self.transports, self._store_addr)

    def _open_lease_rpc(self, raw: bytes) -> wire.LeaseReply:
        msg = wire.decode(raw, wire.OpenLeaseRequest)
        if msg.num_blocks < 0 or not msg.ttl_s > 0:
            raise WireFormatError(f"open_lease needs num_blocks >= 0 and ttl_s > 0, got {msg.num_blocks}, {msg.ttl_s}")
        ttl = min(msg.ttl_s, self.config.lease_ttl_s)
        lease = self.open_lease(
            msg.request_id, num_blocks=msg.num_blocks, prompt_token_ids=msg.prompt_token_ids, ttl_s=ttl
        )
        return wire.LeaseReply(lease)

    def _join_group(self, raw: bytes) -> wire.JoinGroupReply:
        msg = wire.decode(raw, wire.JoinGroup)
        if msg.backend not in self.transports or not issubclass(TRANSPORTS[msg.backend], CollectiveTransport):
            raise TransportError(
                f"receiver {self.receiver_id} does not offer {msg.backend!r} (offers {list(self.transports)})"
            )
        cfg = self.config
        group = collective.make_group(
            msg.pair_id,
            msg.backend,
            self._store,
            collective.RECEIVER_RANK,
            self.device,
            cfg.collective_timeout_s,
            cfg.connect_timeout_s,
        )
        with self._groups_lock:
            old = self._group_by_sender.get((msg.sender_id, msg.backend))
            if old is not None and old in self._groups:
                self._groups.pop(old).close()  # a sender only rejoins after its group broke
            self._groups[msg.pair_id] = group
            self._group_by_sender[(msg.sender_id, msg.backend)] = msg.pair_id
            while len(self._groups) > self.config.max_peer_groups:
                _, oldest = self._groups.popitem(last=False)
                oldest.close()
            self._group_by_sender = {k: v for k, v in self._group_by_sender.items() if v in self._groups}
        return wire.JoinGroupReply(msg.pair_id)

    def _push_collective(self, raw: bytes) -> wire.PushReply:
        msg = wire.decode(raw, wire.CollectivePush)
        with self._groups_lock:
            group = self._groups.get(msg.pair_id)
            if group is not None:
                self._groups.move_to_end(msg.pair_id)
        if group is None or group.broken:  # nothing was received: the sender may rejoin and retry
            raise StaleGroupError(f"collective group {msg.pair_id} is unknown or broken here; rejoin")
        entry = self.leases.get(msg.lease_id)
        deadline = entry.deadline if entry else time.monotonic()
        try:
            return CollectiveTransport.receive_blocks(self, msg, group, deadline)
        except Exception:
            group.close()  # the sender's ops are now unmatched: the group cannot be reused
            raise
        finally:
            if group.broken:
                with self._groups_lock:
                    self._groups.pop(msg.pair_id, None)

    def _complete_rpc(self, raw: bytes) -> wire.LeaseStatus:
        msg = wire.decode(raw, wire.CompleteLease)
        out = self.complete(msg.lease_id, msg.first_token_id)
        return wire.LeaseStatus(out.lease_id, out.state.name, out.reason)

    def complete(self, lease_id: str, first_token_id: int | None = None) -> LeaseOutcome:
        """Completes the lease if every block has arrived (commits them to the reserver); otherwise aborts
        it. Raises LeaseEndedError if it had already ended (e.g. an abort won the race)."""
        with self.leases.guard(lease_id) as entry:
            lease = entry.lease
            missing = lease.num_blocks - entry.num_received
            if missing:
                reason = f"completion with {missing} of {lease.num_blocks} blocks missing"
                self.leases.end_guarded(entry, LeaseState.ABORTED, reason)
                raise LeaseEndedError(f"lease {lease_id} aborted: {reason}")
            try:
                self.reserver.commit(lease.request_id, lease.block_ids, first_token_id)
            except Exception as e:  # the owner refused the blocks: give them back instead of leaking them
                reason = f"commit failed: {type(e).__name__}: {e}"
                self.leases.end_guarded(entry, LeaseState.ABORTED, reason)
                raise KVTransferError(f"lease {lease_id} aborted: {reason}") from e
            out = self.leases.end_guarded(entry, LeaseState.COMPLETED, "", first_token_id)
        assert out is not None
        return out

    def _abort_rpc(self, raw: bytes) -> wire.LeaseStatus:
        msg = wire.decode(raw, wire.AbortLease)
        self.abort(msg.lease_id, f"aborted by the sender: {msg.reason}")
        out = self.leases.outcome(msg.lease_id)
        if out is None:
            return wire.LeaseStatus(msg.lease_id, "UNKNOWN", "")
        return wire.LeaseStatus(msg.lease_id, out.state.name, out.reason)


def max_message_bytes(config: KVTransferConfig, bytes_per_block: int) -> int:
    """Largest gRPC message either side accepts: one chunk of whole blocks plus headers."""
    return max(config.grpc_chunk_bytes, bytes_per_block) + (1 << 20)
