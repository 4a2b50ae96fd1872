"""The receiving side (decode worker): leases on blocks its caller reserved, and the writes into them.

The decode worker owns the destination blocks from start to end: it reserves them in its own
engine, asks the receiver for a lease on them, and ends the lease before it touches them again.
The receiver never calls back into its caller and never frees a block. One receiver per replica;
``lock`` below is the lock held around ``engine.step()``::

    receiver = KVReceiver(PagedKV(engine.kv_cache), KVTransferConfig(host=..., advertise_host=...)).start()

    with lock:
        r = engine.reserve_remote_kv(request_id, prompt_token_ids, params)   # None: no free blocks now
    skip = r.num_cached_tokens // block_size                    # leading blocks are local prefix-cache hits
    lease = receiver.open_lease(request_id, r.block_ids[skip:], first_block=skip)
    #   -> pass ``lease`` (frozen, picklable) to a prefill worker, which calls
    #      ``sender.send(lease, its_block_ids)`` and reports success + the first token in its own result
    out = receiver.outcome(lease.lease_id)
    if prefill_reported_success and out is not None and out.state == LeaseState.COMPLETED:
        with lock:
            engine.complete_remote_kv(request_id, first_token_id, first_logprob)
    else:  # failure, timeout, bad result, client gone: on every other exit, end the lease first
        receiver.abort(lease.lease_id)      # idempotent; once it returns no write lands in the blocks
        with lock:
            engine.fallback_to_local_prefill(request_id)          # or engine.abort_request(request_id)

A lease ends exactly once here: COMPLETED (the sender's ``CompleteLease`` after every block
arrived), ABORTED (``abort`` from either side, a rejected or broken block stream) or EXPIRED
(its deadline passed). Ending records the outcome (``outcome``/``wait``) and metrics, nothing
else. The gRPC service the sender talks to is ``receiver_service.ReceiverService``.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence

import torch

from kv_transfer.blocks import BlockSink
from kv_transfer.config import KVTransferConfig
from kv_transfer.errors import LeaseEndedError, WireFormatError
from kv_transfer.lease import Lease, LeaseOutcome, LeaseState, LeaseTable
from kv_transfer.metrics import TransferMetrics
from kv_transfer.receiver_service import ReceiverService

log = logging.getLogger(__name__)


class KVReceiver:
    """Leases on the caller's blocks of one ``BlockSink``, and the ``BlockWriter`` the transports write through."""

    def __init__(
        self,
        sink: BlockSink,
        config: KVTransferConfig | None = None,
        metrics: TransferMetrics | None = None,
    ):
        self.config = (config or KVTransferConfig()).validate()
        self.sink = sink
        self.layout = sink.layout
        self.device = torch.device(sink.device)
        self.metrics = metrics or TransferMetrics()
        self.receiver_id = uuid.uuid4().hex[:12]
        self.leases = LeaseTable()
        self.service = ReceiverService(self)
        self._lifecycle = threading.Lock()
        self._closed = False

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> KVReceiver:
        """Starts the gRPC service and the lease reaper. Returns self."""
        with self._lifecycle:
            if self._closed:
                raise RuntimeError("a closed KVReceiver cannot be started again")
            self.service.start()
            self.leases.start_reaper(self.config.reaper_interval_s)
        return self

    def close(self) -> None:
        """Stops serving and aborts open leases (their blocks stay the caller's). Idempotent."""
        with self._lifecycle:
            self._closed = True
        self.service.close()
        self.leases.close("receiver shutting down")

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> str:
        """``host:port`` senders reach this receiver at ("" until ``start``)."""
        return self.service.address

    @property
    def transports(self) -> tuple[str, ...]:
        """Data planes this receiver offers, best first."""
        return self.service.transports

    # ---- leases (the decode worker calls these) ----------------------------------------

    def open_lease(
        self,
        request_id: str,
        block_ids: Sequence[int],
        first_block: int = 0,
        ttl_s: float | None = None,
    ) -> Lease:
        """Promises ``block_ids`` - already reserved by the caller in its own pool, in the request's block
        order - to one transfer. ``first_block`` is the index of ``block_ids[0]`` in the request's block
        table (earlier blocks were local cache hits). The lease expires after ``ttl_s`` (default
        ``config.lease_ttl_s``). Raises ValueError for ids outside the sink or duplicated ids."""
        ids = tuple(operator.index(b) for b in block_ids)
        num_blocks = self.layout.num_blocks
        outside = [b for b in ids if not 0 <= b < num_blocks]
        if outside:
            raise ValueError(f"request {request_id}: block ids {outside} are outside this sink's [0, {num_blocks})")
        dups = sorted(b for b, n in Counter(ids).items() if n > 1)
        if dups:
            raise ValueError(f"request {request_id}: block ids {dups} appear more than once")
        first_block = operator.index(first_block)
        if first_block < 0:
            raise ValueError(f"request {request_id}: first_block must be >= 0, got {first_block}")
        ttl = self.config.lease_ttl_s if ttl_s is None else float(ttl_s)
        if not ttl > 0:
            raise ValueError(f"request {request_id}: ttl_s must be > 0, got {ttl_s}")
        address = self.address
        if not address:
            raise RuntimeError("KVReceiver.open_lease before start(): senders could not reach the lease")
        lease = Lease(
            lease_id=uuid.uuid4().hex,
            request_id=request_id,
            block_ids=ids,
            first_block=first_block,
            deadline=time.time() + ttl,
            receiver_addr=address,
            receiver_id=self.receiver_id,
        )
        opened = time.monotonic()  # kept by the table's entry only: gone when the lease ends
        self.leases.add(lease, ttl, lambda lz, out: self._on_end(lz, out, opened))
        return lease

    def _on_end(self, lease: Lease, outcome: LeaseOutcome, opened: float) -> None:
        """Records how the lease ended. Frees nothing: the blocks were the caller's all along."""
        if outcome.state == LeaseState.COMPLETED:
            nbytes = lease.num_blocks * self.layout.bytes_per_block
            self.metrics.record_transfer("all", "received", nbytes, time.monotonic() - opened)
        else:
            self.metrics.add(f"leases_{outcome.state.name.lower()}", "all")
            log.info("lease %s (%s) %s: %s", lease.lease_id, lease.request_id, outcome.state.name, outcome.reason)

    def abort(self, lease_id: str, reason: str = "aborted by the receiver") -> bool:
        """Ends the lease; once this returns no write lands in its blocks. Idempotent: False if it had
        already ended (completed, aborted or expired) or is unknown."""
        return self.leases.end(lease_id, LeaseState.ABORTED, reason) is not None

    def outcome(self, lease_id: str) -> LeaseOutcome | None:
        """How the lease ended; None while it is active (or if unknown)."""
        return self.leases.outcome(lease_id)

    def wait(self, lease_id: str, timeout: float) -> LeaseOutcome:
        """Blocks until the lease ends (outcome.ok tells how); TransferTimeoutError after ``timeout``."""
        return self.leases.wait(lease_id, timeout)

    def num_received(self, lease_id: str) -> int:
        entry = self.leases.get(lease_id)
        return entry.num_received if entry else 0

    # ---- BlockWriter (the transports and the service call these) -----------------------

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

    def complete(self, lease_id: str) -> LeaseOutcome:
        """Completes the lease if every block has arrived; otherwise aborts it (and raises LeaseEndedError).
        Raises LeaseEndedError if it had already ended (e.g. an abort won the race)."""
        with self.leases.guard(lease_id) as entry:
            lease = entry.lease
            missing = lease.num_blocks - entry.num_received
            if missing:
                reason = f"completion with {missing} of {lease.num_blocks} blocks missing"
                self.leases.end_guarded(entry, LeaseState.ABORTED, reason)
                raise LeaseEndedError(f"lease {lease_id} aborted: {reason}")
            out = self.leases.end_guarded(entry, LeaseState.COMPLETED)
        assert out is not None
        return out
