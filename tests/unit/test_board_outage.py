"""A pool board that stops answering (Serve restarting it, its node gone) stalls neither side that calls it: the
edge answers /health and /admin/pools from its last snapshot, less the reports gone stale, and asks again
later; a replica's reporter gives up the lost report and reports again. Without the bound on each call, a call
that never returned (one to a board on a node gone silent) stopped that side's stats for as long as it hung."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx

from cluster.serving.config import parse_serve_config
from cluster.serving.messages import ReplicaStats
from cluster.serving.pool_board import board_call_timeout_s
from cluster.serving.replica_lifecycle import ReplicaReporter
from router.server import OpenAIServer
from tests.unit.test_openai_endpoints import EchoWorker

PERIOD_S = 0.05


class _Call:
    """``board.<method>.remote()`` as a Serve handle spells it, answered by ``answer`` (which may never return)."""

    def __init__(self, answer):
        self.answer = answer
        self.calls = 0

    async def remote(self, *args):
        self.calls += 1
        return await self.answer(*args)


async def _never(*_args):
    await asyncio.Event().wait()


class FlakyBoard:
    """Answers snapshots with ``stats`` while ``up``; while down, every call hangs, like one sent to a dead replica."""

    def __init__(self, stats: list[ReplicaStats]):
        self.stats = stats
        self.up = True
        self.reports: list[ReplicaStats] = []
        self.snapshot = _Call(self._snapshot)
        self.report = _Call(self._report)

    async def _snapshot(self):
        if not self.up:
            await _never()
        return self.stats

    async def _report(self, stats):
        if not self.up:
            await _never()
        self.reports.append(stats)


def test_the_edge_answers_from_its_last_snapshot_while_the_board_is_away(demo_model):
    asyncio.run(asyncio.wait_for(_edge_answers_while_the_board_is_away(demo_model), 60))  # a hang fails, not stalls


async def _edge_answers_while_the_board_is_away(demo_model):
    fresh = ReplicaStats(pool="prefill", replica_id="p1")
    stale = ReplicaStats(pool="decode", replica_id="d-old", reported_at=time.time() - 3600)
    board = FlakyBoard([fresh, stale])
    cfg = parse_serve_config({"device": "cpu", "routing_stats_period_s": PERIOD_S, "enable_admin_api": True})
    server = OpenAIServer(cfg, str(demo_model), EchoWorker(), board=board, disaggregated=True)
    transport = httpx.ASGITransport(app=server.asgi_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://edge", timeout=30) as client:
        ids = [r["replica_id"] for r in (await client.get("/admin/pools")).json()["replicas"]]
        assert ids == ["p1", "d-old"]  # what the board says is passed on as it is

        board.up = False
        started = time.monotonic()
        health = await client.get("/health")
        pools = await client.get("/admin/pools")
        waited = time.monotonic() - started
        # Each call gave up after its bound, not never; the prefill replica reported recently, so it is still up.
        assert waited < 2 * board_call_timeout_s(PERIOD_S) + 1.5, waited
        assert health.status_code == 200, health.text
        assert [r["replica_id"] for r in pools.json()["replicas"]] == ["p1"]  # the stale report is dropped

        board.up = True
        board.stats = [ReplicaStats(pool="prefill", replica_id="p2")]
        ids = [r["replica_id"] for r in (await client.get("/admin/pools")).json()["replicas"]]
        assert ids == ["p2"]  # the board is asked again once it is back


def test_a_report_lost_to_a_dead_board_does_not_stop_the_reports():
    asyncio.run(_reports_go_on_after_a_lost_one())


async def _reports_go_on_after_a_lost_one():
    board = FlakyBoard([])
    board.up = False  # the first report goes to a board that never answers
    busy_engine = SimpleNamespace(stats=lambda: SimpleNamespace(active_requests=1))  # busy: no integrity check
    reporter = ReplicaReporter.start(busy_engine, board, lambda: ReplicaStats("decode", "d1"), PERIOD_S)
    try:
        await asyncio.sleep(0.2)
        assert board.report.calls == 1 and not board.reports  # stuck on the lost call, as a dead board leaves it
        board.up = True
        deadline = time.monotonic() + board_call_timeout_s(PERIOD_S) + 5
        while not board.reports and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert board.reports and board.reports[-1].replica_id == "d1"
    finally:
        reporter.stop()
