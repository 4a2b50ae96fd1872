"""What every pool replica does besides serving: report its stats, and configure its KV endpoint."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from cluster.serving.async_engine import AsyncEngine
from cluster.serving.config import ServeConfig
from cluster.serving.messages import ReplicaStats
from cluster.serving.pool_board import board_call_timeout_s
from kv_transfer import KVTransferConfig

log = logging.getLogger(__name__)

#: Pools larger than this skip the periodic integrity check (it walks every block).
MAX_BLOCKS_FOR_INTEGRITY_CHECK = 16384


class ReplicaReporter:
    """Sends the replica's ``ReplicaStats`` to the pool board every ``period_s`` (with a block-pool
    integrity check on small idle pools); a board restart never stops the replica."""

    def __init__(self, engine: AsyncEngine, board: Any, stats: Callable[[], ReplicaStats], period_s: float):
        self.engine = engine
        self.board = board
        self.stats = stats
        self.period_s = period_s
        self.integrity_ok: bool | None = None
        self._task: asyncio.Task | None = None

    @classmethod
    def start(
        cls, engine: AsyncEngine, board: Any, stats: Callable[[], ReplicaStats], period_s: float
    ) -> ReplicaReporter:
        reporter = cls(engine, board, stats, period_s)
        reporter._task = asyncio.get_running_loop().create_task(reporter._run())
        return reporter

    async def _run(self) -> None:
        while True:
            try:
                # The check walks every block on the engine thread: only while it has nothing to run.
                idle = self.engine.stats().active_requests == 0
                if idle and self.engine.engine.kv_layout.num_blocks <= MAX_BLOCKS_FOR_INTEGRITY_CHECK:
                    self.integrity_ok = await self.engine.check_integrity()
                await asyncio.wait_for(self.board.report.remote(self.stats()), board_call_timeout_s(self.period_s))
            except Exception as e:  # noqa: BLE001  (a timeout too: the next period reports afresh)
                log.debug("stats report failed: %r", e)
            await asyncio.sleep(self.period_s)

    def stop(self) -> None:
        """Idempotent; safe after the event loop closed."""
        if self._task is not None and not self._task.done():
            try:
                self._task.cancel()
            except RuntimeError:  # its loop is already closed
                pass


def transfer_config(config: ServeConfig, host: str | None = None) -> KVTransferConfig:
    """The kv_transfer configuration of a pool replica; the one place the lease TTL comes from."""
    return KVTransferConfig(
        transport=config.transport,
        host=host or "127.0.0.1",
        lease_ttl_s=config.timeouts.lease_ttl_s,
    )


def seconds_since_process_start() -> float:
    """Seconds since this process started: called at the end of a replica's start-up, its measured start-up (Ray
    starts a worker process for each replica: imports, engine, weights and kernel probes all count)."""
    import psutil  # Ray ships it (ray/thirdparty_files, on the path once ray is imported): every replica has it

    return max(0.0, time.time() - psutil.Process().create_time())
