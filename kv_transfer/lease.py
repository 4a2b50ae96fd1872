"""Transfer leases: the only way KV blocks are promised to a transfer.

The receiver's caller (the decode side) reserves destination blocks in its own pool and asks
the receiver for a ``Lease`` on them. Each side keeps its own ``LeaseTable``; on each side a
lease ends exactly once - COMPLETED, ABORTED or EXPIRED - and the table runs that side's
``on_end`` callback exactly once (the receiver only records the outcome and metrics: the
blocks stay the caller's; the sender releases its source blocks). Ending is idempotent: a
second abort, or an abort that races a completion, is a no-op that reports the first outcome.

Writers (a chunk scattered into leased blocks, a gather from source blocks) hold the lease's
lock through ``table.guard(lease_id)``, so a lease never ends in the middle of a write and
nothing is written once it has ended: when ``end`` returns, the blocks are the owner's again.

Memory: an active lease lives in the table until it ends (the reaper expires it at its
deadline at the latest); an ended one leaves only its ``LeaseOutcome`` in a bounded record of
the last ``max_ended`` outcomes, so a late abort/complete/wait gets an answer.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from kv_transfer.errors import LeaseEndedError, TransferTimeoutError

log = logging.getLogger(__name__)


class LeaseState(enum.IntEnum):
    ACTIVE = 0
    # Everything from here on has ended: ``state >= COMPLETED``.
    COMPLETED = 1
    ABORTED = 2
    EXPIRED = 3

    @property
    def is_ended(self) -> bool:
        return self >= LeaseState.COMPLETED


@dataclass(frozen=True)
class Lease:
    """Destination blocks promised to one request's transfer. Crosses processes (msgpack, pickle)."""

    lease_id: str
    request_id: str
    #: Destination block ids on the receiver, in the request's block order.
    block_ids: tuple[int, ...]
    #: Index of ``block_ids[0]`` in the request's block table: blocks before it were local
    #: prefix-cache hits on the receiver and are not transferred.
    first_block: int
    #: Wall-clock (``time.time()``) deadline; assumes peers' clocks agree to well under the TTL.
    deadline: float
    #: ``host:port`` of the receiver's gRPC service.
    receiver_addr: str
    receiver_id: str

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def time_left(self) -> float:
        return self.deadline - time.time()


@dataclass(frozen=True)
class LeaseOutcome:
    lease_id: str
    request_id: str
    state: LeaseState
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.state == LeaseState.COMPLETED


OnEnd = Callable[[Lease, LeaseOutcome], None]


@dataclass(eq=False)
class LeaseEntry:
    lease: Lease
    deadline: float  # this side's clock (monotonic)
    on_end: OnEnd
    state: LeaseState = LeaseState.ACTIVE
    outcome: LeaseOutcome | None = None
    received: bytearray = field(default_factory=bytearray)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def num_received(self) -> int:
        return sum(self.received)

    def mark_received(self, start: int, count: int) -> None:
        self.received[start : start + count] = b"\x01" * count


class LeaseTable:
    """Leases of one side, by id; a reaper thread expires the ones past their deadline."""

    #: Ended leases remembered so a late abort/complete/wait gets an answer, not "unknown". The only
    #: record of ended leases; the oldest is dropped first.
    max_ended = 4096

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_ended: int | None = None):
        self._clock = clock
        if max_ended is not None:
            if max_ended < 1:
                raise ValueError(f"max_ended must be >= 1, got {max_ended}")
            self.max_ended = max_ended
        self._lock = threading.Lock()
        self._active: dict[str, LeaseEntry] = {}
        self._ended: OrderedDict[str, LeaseOutcome] = OrderedDict()
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()

    # ---- queries (do not modify the table) ---------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._active)

    def get(self, lease_id: str) -> LeaseEntry | None:
        with self._lock:
            return self._active.get(lease_id)

    def outcome(self, lease_id: str) -> LeaseOutcome | None:
        """The outcome of an ended lease, or None while it is active or if unknown."""
        with self._lock:
            return self._ended.get(lease_id)

    # ---- state changes -----------------------------------------------------------------

    def add(self, lease: Lease, ttl_s: float, on_end: OnEnd) -> LeaseEntry:
        """Starts tracking ``lease``; it ends at the latest ``ttl_s`` from now. LeaseEndedError after ``close``."""
        entry = LeaseEntry(lease, self._clock() + ttl_s, on_end, received=bytearray(lease.num_blocks))
        with self._lock:
            if self._stop.is_set():  # nothing would expire it any more
                raise LeaseEndedError(f"lease {lease.lease_id} refused: this side is shutting down")
            if lease.lease_id in self._active:
                raise ValueError(f"lease {lease.lease_id} is already in the table")
            ended = self._ended.get(lease.lease_id)
            if ended is not None:  # ended before it began here: its blocks may already be someone else's
                why = f": {ended.reason}" if ended.reason else ""
                raise LeaseEndedError(f"lease {lease.lease_id} refused: already {ended.state.name.lower()}{why}")
            self._active[lease.lease_id] = entry
        return entry

    def end(
        self, lease_id: str, state: LeaseState, reason: str = "", *, refuse_if_not_begun: bool = False
    ) -> LeaseOutcome | None:
        """Ends the lease with ``state`` and runs its ``on_end`` once. Idempotent: returns the outcome
        if this call ended it, None if it had already ended (or is unknown).

        ``refuse_if_not_begun``: a lease this side has not seen yet is remembered as ended, and a later ``add``
        of it is refused. The prefill replica ends its sender's leases this way when a prefill runs out of time: the
        send it started on a worker thread (which the timeout cannot stop) may reach ``add`` only afterwards,
        when the source blocks have been freed and may hold another request's KV."""
        with self._lock:
            entry = self._active.get(lease_id)
            if entry is None:
                if refuse_if_not_begun and lease_id not in self._ended:
                    self._remember(LeaseOutcome(lease_id, "", state, reason or "ended before it began"))
                return None
        with entry.lock:
            return self.end_guarded(entry, state, reason)

    def end_guarded(self, entry: LeaseEntry, state: LeaseState, reason: str = "") -> LeaseOutcome | None:
        """Like ``end`` for a caller inside ``guard(lease_id)`` (holding ``entry.lock``). The callback runs
        under the lock: no write can interleave with the end, and none follows it."""
        assert state.is_ended
        if entry.state.is_ended:
            return None
        lease = entry.lease
        entry.state = state
        outcome = LeaseOutcome(lease.lease_id, lease.request_id, state, reason)
        try:
            entry.on_end(lease, outcome)
        except Exception as e:  # the lease has ended either way; a failing callback must not keep it alive
            log.exception("on_end of lease %s failed", lease.lease_id)
            outcome = LeaseOutcome(lease.lease_id, lease.request_id, state, f"{reason}; on_end failed: {e!r}")
        entry.outcome = outcome
        with self._lock:
            self._active.pop(lease.lease_id, None)
            self._remember(outcome)
        entry.done.set()
        return outcome

    def _remember(self, outcome: LeaseOutcome) -> None:
        """Records an ended lease's outcome (the caller holds ``self._lock``); the oldest record goes first."""
        self._ended[outcome.lease_id] = outcome
        while len(self._ended) > self.max_ended:
            self._ended.popitem(last=False)

    @contextmanager
    def guard(self, lease_id: str) -> Iterator[LeaseEntry]:
        """Holds the lease for a write (or a gather of its blocks). Raises LeaseEndedError if it has
        ended or is past its deadline (then it expires here). The lease cannot end inside the block."""
        entry = self.get(lease_id)
        if entry is None:
            raise self.ended_error(lease_id)
        with entry.lock:
            if not entry.state.is_ended and self._clock() >= entry.deadline:
                self.end_guarded(entry, LeaseState.EXPIRED, "lease deadline passed")
            if entry.state.is_ended:
                raise self.ended_error(lease_id)
            yield entry

    def ended_error(self, lease_id: str) -> LeaseEndedError:
        """The error that says why ``lease_id`` is not active (ended how, or unknown)."""
        out = self.outcome(lease_id)
        if out is None:
            return LeaseEndedError(f"lease {lease_id} is unknown here (never opened, or ended long ago)")
        why = f": {out.reason}" if out.reason else ""
        return LeaseEndedError(f"lease {lease_id} was already {out.state.name.lower()}{why}")

    def wait(self, lease_id: str, timeout: float) -> LeaseOutcome:
        """Blocks until the lease ends; raises TransferTimeoutError after ``timeout`` s, LeaseEndedError if unknown."""
        entry = self.get(lease_id)
        if entry is None:
            out = self.outcome(lease_id)
            if out is None:
                raise self.ended_error(lease_id)
            return out
        if not entry.done.wait(timeout):
            raise TransferTimeoutError(f"lease {lease_id} did not end within {timeout:.1f}s")
        assert entry.outcome is not None
        return entry.outcome

    def reap(self) -> list[LeaseOutcome]:
        """Expires every active lease past its deadline; returns their outcomes."""
        now = self._clock()
        with self._lock:
            due = [e for e in self._active.values() if e.deadline <= now]
        outcomes = []
        for entry in due:
            out = self.end(entry.lease.lease_id, LeaseState.EXPIRED, "lease deadline passed before completion")
            if out is not None:
                outcomes.append(out)
        return outcomes

    def start_reaper(self, interval_s: float) -> None:
        if self._reaper is not None:
            return
        self._reaper = threading.Thread(target=self._reap_loop, args=(interval_s,), name="kv-lease-reaper", daemon=True)
        self._reaper.start()

    def _reap_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.reap()
            except Exception:
                log.exception("lease reaper failed")

    def close(self, reason: str = "shutting down") -> None:
        """Stops the reaper and aborts every active lease (each side's ``on_end`` runs for it)."""
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        with self._lock:
            ids = list(self._active)
        for lease_id in ids:
            self.end(lease_id, LeaseState.ABORTED, reason)
