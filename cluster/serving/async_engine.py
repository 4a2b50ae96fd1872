"""Drives a synchronous ``LLMEngine`` from asyncio: one dedicated thread runs the step loop.

The engine is single-threaded, so every engine call goes through ``call(fn)``: the function
is queued and runs on the engine thread between two steps (no locks around the engine).
Each request's outputs come back on its own ``asyncio.Queue`` (registered when the request
enters the engine), so a pool replica's handlers just ``await queue.get()``. Runs without Ray.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import statistics
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from cluster.engine.llm_engine import LLMEngine, RequestOutput
from cluster.engine.request import RequestStatus
from cluster.serving.metrics import BatchGeometry

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDead(RuntimeError):
    """The engine thread stopped (shutdown or a failed step); requests on it cannot finish."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        self.geometry = BatchGeometry()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    # ---- calls from the event loop ---------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread between two steps and returns its result."""
        result, _ = await self._submit(fn, None)
        return result

    async def call_with_stream(self, fn: Callable[[LLMEngine], T], request_id: str) -> tuple[T, asyncio.Queue]:
        """Like ``call``; if ``fn`` succeeds, ``request_id``'s outputs go to the returned queue from the
        same engine-thread turn on (so none is missed, even if the request finishes at the next step)."""
        return await self._submit(fn, request_id)

    async def _submit(self, fn: Callable[[LLMEngine], T], stream_id: str | None) -> tuple[T, asyncio.Queue | None]:
        if not self.alive:
            raise EngineDead(f"engine is not running: {self._error!r}")
        fut: Future = Future()
        q: asyncio.Queue | None = asyncio.Queue() if stream_id is not None else None

        def command() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(self.engine)
                except BaseException as e:  # handed to the awaiting caller  # noqa: BLE001
                    fut.set_exception(e)
                    return
                if q is not None:
                    self._streams[stream_id] = q
                fut.set_result(result)

        self._commands.put(command)
        return await asyncio.wrap_future(fut), q

    async def add_request(
        self, request_id: str, prompt: list[int], params, hold_kv_on_finish: bool = False
    ) -> asyncio.Queue:
        _, q = await self.call_with_stream(
            lambda e: e.add_request(request_id, prompt, params, hold_kv_on_finish), request_id
        )
        return q

    def abort(self, request_id: str) -> None:
        """Frees the request's blocks at the next engine turn. Idempotent; never blocks; safe after finish."""

        def command() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

        self._commands.put(command)

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                busy = self.engine.has_unfinished_requests()
                self._drain_commands(block=not busy)
                if self.engine.has_unfinished_requests():
                    try:
                        self._step()
                    except Exception as e:  # noqa: BLE001 - the engine isolates a request's failure itself;
                        self._recover(e)  # this is a failure it could not pin on one request
        except BaseException as e:  # unrecoverable: fail every request instead of hanging them
            log.exception("engine loop failed")
            self._error = e
            for q in self._streams.values():
                self.loop.call_soon_threadsafe(q.put_nowait, EngineDead(f"engine step failed: {e!r}"))
            self._streams.clear()

    def _recover(self, error: Exception) -> None:
        """Ends every request in the engine with an error (their state may be half-updated) and keeps the
        loop going if the block pool is whole afterwards; raises ``error`` when it is not."""
        log.exception("engine step failed; ending the %d requests in the engine", len(self.engine.requests))
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
            q = self._streams.pop(rid, None)
            if q is not None:
                self.loop.call_soon_threadsafe(q.put_nowait, EngineDead(f"engine step failed: {error!r}"))
        self.engine.block_pool.check_integrity()  # AssertionError: the pool is corrupt, the loop must end

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self.idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            cmd()
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        e = self.engine
        before = {rid: (r.num_computed_tokens, r.num_tokens - r.num_computed_tokens) for rid, r in e.requests.items()}
        outputs = e.step()
        self.num_steps += 1
        self.geometry = self._geometry(before)
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            self.loop.call_soon_threadsafe(q.put_nowait, out)

    def _geometry(self, before: dict[str, tuple[int, int]]) -> BatchGeometry:
        e = self.engine
        running = e.scheduler.running
        computed = prefill = 0
        for rid, (done_before, todo_before) in before.items():
            r = e.requests.get(rid)
            if r is None or r.status == RequestStatus.PREEMPTED:
                continue
            delta = max(0, r.num_computed_tokens - done_before)
            computed += delta
            if todo_before > 1:
                prefill += delta
        lengths = [r.num_tokens for r in running]
        cv = statistics.pstdev(lengths) / statistics.mean(lengths) if len(lengths) > 1 else 0.0
        blocks = sum(len(r.block_ids) for r in running)
        return BatchGeometry(
            num_seqs=len(running),
            num_tokens=computed,
            prefill_fraction=prefill / computed if computed else 0.0,
            length_cv=cv,
            max_min_ratio=max(lengths) / min(lengths) if lengths else 0.0,
            kv_footprint_bytes=blocks * e.kv_layout.bytes_per_block,
        )

    # ---- stats (read from any thread; plain numbers, may be one step stale) ------------------

    def snapshot(self) -> dict[str, Any]:
        e = self.engine
        sched = e.scheduler
        pool = e.block_pool
        queued_prefill = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in list(sched.waiting))
        queued_prefill += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in list(sched.running))
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting) + len(sched.remote),
            "waiting_for_remote_kv": len(sched.remote),
            "held_kv_requests": sum(1 for r in list(e.requests.values()) if r.is_finished),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used_blocks,
            "kv_blocks_free": pool.num_free_blocks,
            "kv_dtype": e.kv_layout.dtype,
            "prefix_queries": pool.num_cache_queries,
            "prefix_hits": pool.num_cache_hits,
            "preemptions": sched.num_preemptions,
            "steps": self.num_steps,
            "queued_prefill_tokens": queued_prefill,
            "active_requests": len(e.requests),
            "geometry": self.geometry,
        }

    async def check_integrity(self) -> bool:
        def check(e: LLMEngine) -> bool:
            try:
                e.block_pool.check_integrity()
                return True
            except AssertionError:
                return False

        return await self.call(check)


async def next_output(q: asyncio.Queue) -> RequestOutput:
    item = await q.get()
    if isinstance(item, BaseException):
        raise item
    return item
