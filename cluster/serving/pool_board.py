"""The pool board: the latest ``ReplicaStats`` of every pool replica, for /health, /metrics and /admin/pools.

Replicas report to it every ``routing_stats_period_s`` and the HTTP edges read it, through a Serve handle:
``board.report.remote(stats)``, ``await board.snapshot.remote()``. Where there is only one replica to report,
the default on a small node (one decode replica that also prefills), the board lives in that replica's
process instead (``InProcessBoard``: the same calls, no process of its own). A board deployment is one more Ray
worker process, and every Ray worker wakes up every 10 ms even when idle: on two cores those wake-ups land on
the cores the engine computes on, and stall its parallel regions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from cluster.serving.messages import ReplicaStats


def board_stale_after_s(report_period_s: float) -> float:
    """How old a replica's last report may be before the board (and an edge's copy of it) drops it: several
    missed reports, so one slow report never makes a live replica disappear."""
    return max(3.0, 6 * report_period_s)


def fresh_reports(reports: Iterable[ReplicaStats], stale_after_s: float) -> list[ReplicaStats]:
    """The reports younger than ``stale_after_s``: the one staleness rule, for the board and an edge's copy alike."""
    cutoff = time.time() - stale_after_s
    return [s for s in reports if s.reported_at >= cutoff]


def board_call_timeout_s(report_period_s: float) -> float:
    """How long a report or a snapshot may take before the caller gives it up and tries again later. A killed
    board process fails the calls in flight at once, but a call to one on a node that went silent waits until Ray
    declares the node dead, if ever; unbounded, the reporter stopped reporting and the edge stopped refreshing for
    that long, each behind its one call (a CI run saw the decode replica missing from the board for over a minute
    after the board's node went)."""
    return max(1.0, 4 * report_period_s)


class PoolBoard:
    """The latest ``ReplicaStats`` of every pool replica.

    Reports older than ``stale_after_s`` are dropped: a dead replica disappears on its own.
    """

    def __init__(self, stale_after_s: float):
        self.stale_after_s = stale_after_s
        self._latest: dict[tuple[str, str], ReplicaStats] = {}

    def report(self, stats: ReplicaStats) -> None:
        self._latest[(stats.pool, stats.replica_id)] = stats

    def snapshot(self) -> list[ReplicaStats]:
        self._latest = {(s.pool, s.replica_id): s for s in fresh_reports(self._latest.values(), self.stale_after_s)}
        return sorted(self._latest.values(), key=lambda s: (s.pool, s.replica_id))


class _AwaitableCall:
    """``method.remote(*args)`` as a Serve handle spells it, answered at once by a local call."""

    def __init__(self, method: Callable[..., Any]):
        self._method = method

    async def remote(self, *args: Any) -> Any:
        return self._method(*args)


class InProcessBoard:
    """A ``PoolBoard`` in the process of the one replica that reports to it, behind a handle's call shape."""

    def __init__(self, board: PoolBoard):
        self.report = _AwaitableCall(board.report)
        self.snapshot = _AwaitableCall(board.snapshot)
