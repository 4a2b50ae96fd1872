"""Lease table: each lease ends exactly once, its callback runs once, expiry, guards, races, bounded memory."""

from __future__ import annotations

import threading
import time

import pytest

from kv_transfer.errors import LeaseEndedError, TransferTimeoutError
from kv_transfer.lease import Lease, LeaseState, LeaseTable


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make_lease(i: int = 0, n: int = 3) -> Lease:
    return Lease(f"lease-{i}", f"req-{i}", tuple(range(n)), 0, time.time() + 60, "addr", "recv")


def test_end_runs_callback_once_and_is_idempotent():
    table = LeaseTable()
    calls = []
    table.add(make_lease(), 10, lambda lease, out: calls.append(out.state))
    first = table.end("lease-0", LeaseState.ABORTED, "client gone")
    assert first is not None and first.state == LeaseState.ABORTED and first.reason == "client gone"
    assert table.end("lease-0", LeaseState.ABORTED) is None
    assert table.end("lease-0", LeaseState.COMPLETED) is None
    assert table.end("never-opened", LeaseState.ABORTED) is None
    assert calls == [LeaseState.ABORTED]
    assert table.outcome("lease-0") == first and len(table) == 0


def test_reap_expires_only_leases_past_deadline():
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    ended = []
    table.add(make_lease(0), 1.0, lambda lease, out: ended.append((lease.lease_id, out.state)))
    table.add(make_lease(1), 5.0, lambda lease, out: ended.append((lease.lease_id, out.state)))
    assert table.reap() == []
    clock.now += 1.0
    assert [o.lease_id for o in table.reap()] == ["lease-0"]
    assert ended == [("lease-0", LeaseState.EXPIRED)]
    assert table.get("lease-1") is not None


def test_guard_refuses_ended_or_overdue_leases():
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    states = []
    table.add(make_lease(0), 1.0, lambda lease, out: states.append(out.state))
    with table.guard("lease-0") as entry:
        entry.mark_received(0, 2)
    assert table.get("lease-0").num_received == 2
    clock.now += 2.0  # overdue, reaper not run yet: the guard itself expires it
    with pytest.raises(LeaseEndedError, match="already expired"):
        with table.guard("lease-0"):
            pass
    assert states == [LeaseState.EXPIRED]
    with pytest.raises(LeaseEndedError, match="unknown"):
        with table.guard("nope"):
            pass


def test_lease_cannot_end_during_a_guarded_write():
    table = LeaseTable()
    table.add(make_lease(), 10, lambda lease, out: None)
    in_write, ended = threading.Event(), threading.Event()

    def abort():
        in_write.wait()
        table.end("lease-0", LeaseState.ABORTED)
        ended.set()

    t = threading.Thread(target=abort)
    t.start()
    with table.guard("lease-0"):
        in_write.set()
        assert not ended.wait(0.2), "abort ended the lease in the middle of a write"
    t.join(2)
    assert ended.is_set()


def race_complete_and_abort() -> None:
    table = LeaseTable()
    calls = []
    table.add(make_lease(), 10, lambda lease, out: calls.append(out.state))
    barrier = threading.Barrier(3)
    results = {}

    def run(state):
        barrier.wait()
        results[state] = table.end("lease-0", state)

    threads = [threading.Thread(target=run, args=(s,)) for s in (LeaseState.COMPLETED, LeaseState.ABORTED)]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    assert len(calls) == 1
    winners = [s for s, out in results.items() if out is not None]
    assert winners == calls


def test_abort_racing_completion_ends_exactly_once():
    for _ in range(200):
        race_complete_and_abort()


def test_wait_and_reaper_thread():
    table = LeaseTable()
    table.add(make_lease(), 0.2, lambda lease, out: None)
    with pytest.raises(TransferTimeoutError):
        table.wait("lease-0", 0.01)
    table.start_reaper(0.02)
    try:
        t0 = time.monotonic()
        out = table.wait("lease-0", 2.0)
        assert out.state == LeaseState.EXPIRED and time.monotonic() - t0 < 1.0
        assert table.wait("lease-0", 0) == out  # ended leases answer at once
    finally:
        table.close()


def test_close_aborts_active_leases_and_failing_callback_still_ends():
    table = LeaseTable()

    def boom(lease, out):
        raise RuntimeError("pool gone")

    table.add(make_lease(0), 10, boom)
    table.close("shutdown")
    out = table.outcome("lease-0")
    assert out.state == LeaseState.ABORTED and "pool gone" in out.reason


def test_table_keeps_no_record_of_ended_leases_beyond_max_ended():
    """Completed, aborted and expired leases leave only their outcome, and only the last ``max_ended``."""
    clock = FakeClock()
    table = LeaseTable(clock=clock, max_ended=8)
    ends = []
    for i in range(300):
        table.add(make_lease(i), 1.0 if i % 3 == 2 else 60.0, lambda lease, out: ends.append(out.state))
        if i % 3 == 0:
            with table.guard(f"lease-{i}") as entry:
                table.end_guarded(entry, LeaseState.COMPLETED)
        elif i % 3 == 1:
            assert table.end(f"lease-{i}", LeaseState.ABORTED, "client gone") is not None
        if i % 30 == 29:
            clock.now += 2.0
            assert len(table.reap()) == 10
    assert len(ends) == 300 and len(table) == 0
    assert not table._active and len(table._ended) == 8
    assert not hasattr(table, "_finished") and not hasattr(table, "poll_finished")
    assert table.outcome("lease-299").state == LeaseState.EXPIRED  # the most recent are remembered
    assert table.outcome("lease-0") is None  # the oldest are forgotten ...
    assert table.end("lease-0", LeaseState.ABORTED) is None  # ... and a late abort is still a no-op
    with pytest.raises(LeaseEndedError, match="unknown"):
        table.wait("lease-0", 0)


def test_no_lease_is_added_after_close():
    table = LeaseTable()
    table.close()
    with pytest.raises(LeaseEndedError, match="shutting down"):
        table.add(make_lease(), 10, lambda lease, out: None)
    assert len(table) == 0


def test_a_lease_ended_before_it_was_added_is_refused():
    # The prefill replica ends its sender's lease when a prefill runs out of time; the send it started on a
    # worker thread may reach ``add`` only afterwards, when the source blocks are free and may be another
    # request's: it must not begin.
    table = LeaseTable()
    calls = []
    assert table.end("lease-0", LeaseState.ABORTED, "prefill ended", refuse_if_not_begun=True) is None
    with pytest.raises(LeaseEndedError, match="aborted: prefill ended"):
        table.add(make_lease(0), 10, lambda lease, out: calls.append(out))
    assert len(table) == 0 and calls == []
    assert table.outcome("lease-0").state == LeaseState.ABORTED
    # another lease is unaffected, and a second end of the unknown one changes nothing
    table.add(make_lease(1), 10, lambda lease, out: calls.append(out))
    assert table.end("lease-0", LeaseState.EXPIRED, refuse_if_not_begun=True) is None
    assert table.outcome("lease-0").reason == "prefill ended"
    assert len(table) == 1
    # without the flag an unknown lease's end leaves no record (a late abort of a forgotten lease)
    assert table.end("lease-2", LeaseState.ABORTED) is None and table.outcome("lease-2") is None
