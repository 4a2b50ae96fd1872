"""What every pool replica does besides serving: report its stats, and stop cleanly.

Both pools (prefill and decode) run these; only the KV-transfer endpoint they close differs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: Pools larger than this skip the periodic integrity check (it walks every block).
MAX_BLOCKS_FOR_INTEGRITY_CHECK = 16384


async def report_stats_forever(engine, board, stats: Callable[[], Any], on_integrity: Callable[[bool], None], period_s: float) -> None:
    """Sends ``stats()`` to the pool board every ``period_s``; a board restart never stops the replica."""
    while True:
        try:
            if engine.engine.kv_layout.num_blocks <= MAX_BLOCKS_FOR_INTEGRITY_CHECK:
                on_integrity(await engine.check_integrity())
            await board.report.remote(stats())
        except Exception as e:  # noqa: BLE001
            log.debug("stats report failed: %r", e)
        await asyncio.sleep(period_s)


def stop_replica(reporter: asyncio.Task | None, transfer_endpoint, engine) -> None:
    """Stops the stats reporter, the KV sender/receiver and the engine thread. Idempotent; any may be None."""
    if reporter is not None and not reporter.done():
        try:
            reporter.cancel()
        except RuntimeError:  # its loop is already closed
            pass
    if transfer_endpoint is not None:
        transfer_endpoint.close()
    if engine is not None:
        engine.shutdown()
