"""Several choices in one response (a list of prompts, ``n`` > 1): each choice is its own engine request (a
``router.server.RequestRun``), started together, collected or streamed together, and ended together.

Ending is all-or-nothing: when one choice fails, or the client goes away, every other one is cancelled (its
backend stream closed, so the engine aborts it and frees its blocks) before the error or the close goes on.
Streamed choices interleave their events as the engine produces them; ``[DONE]`` (after the summed usage when
asked for) comes once, after the last.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, TypeVar

from cluster.openai_protocol import APIError
from cluster.openai_responses import ChoiceContent, Usage, usage
from cluster.serving.messages import Started
from router.streaming import DONE, sse_event

if TYPE_CHECKING:
    from router.server import RequestRun

T = TypeVar("T")


def sequence_seed(seed: int, j: int) -> int:
    """Sequence j's seed: ``seed + j``, wrapped within the signed 64-bit range the engine takes (sequence 0 keeps
    the client's seed, so its choice is the one an n=1 request with that seed gets)."""
    return (seed + j + 2**63) % 2**64 - 2**63


async def _all_or_none(coros: Sequence[Awaitable[T]]) -> list[T]:
    """Every result, or the first exception once the others are cancelled and have finished cancelling."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def start_all(runs: Sequence[RequestRun]) -> list[Started]:
    return await _all_or_none([r.start() for r in runs])


async def end_all(runs: Sequence[RequestRun]) -> None:
    """Ends every run (idempotent per run): aborted in the engine, tickets and metrics closed."""
    await asyncio.gather(*(r._end("cancelled") for r in runs), return_exceptions=True)


async def collect_all(runs: Sequence[RequestRun]) -> list[ChoiceContent]:
    """The choices in ``index`` order; the first failure cancels the rest and is raised."""
    found = await _all_or_none([r.collect_choice() for r in runs])
    return sorted(found, key=lambda c: c.index)


def total_usage(runs: Sequence[RequestRun], n: int) -> Usage:
    """Each prompt's tokens once (its n sequences share it), every sequence's output tokens."""
    firsts = [r for r in runs if r.index % n == 0]
    return usage(
        sum(len(r.plan.prompt_token_ids) for r in firsts),
        sum(r.num_output for r in runs),
        sum(r.num_cached for r in firsts),
    )


_FINISHED = object()


async def stream_all(runs: Sequence[RequestRun], n: int) -> AsyncIterator[bytes]:
    """The SSE body: every run's events as they come, then the usage (if asked for) and ``[DONE]``; the first
    failing run's error event ends the stream after the others are cancelled."""
    created = int(time.time())
    encoders = [r.encoder(created) for r in runs]
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(run: RequestRun, encoder) -> None:
        try:
            async with aclosing(run.chunks(encoder)) as chunks:
                async for chunk in chunks:
                    queue.put_nowait(chunk)
            queue.put_nowait(_FINISHED)
        except APIError as e:
            queue.put_nowait(e)

    pumps = [asyncio.ensure_future(pump(r, e)) for r, e in zip(runs, encoders, strict=True)]
    try:
        running = len(pumps)
        while running:
            item = await queue.get()
            if item is _FINISHED:
                running -= 1
            elif isinstance(item, APIError):
                yield sse_event(item.body()) + DONE
                return
            else:
                yield item
        include_usage = runs[0].req.include_usage
        yield (encoders[0].usage(total_usage(runs, n)) if include_usage else b"") + DONE
    finally:  # done, failed, or the client went away (the generator is closed): no run outlives the response
        for p in pumps:
            p.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await end_all(runs)
