"""Drives a synchronous ``LLMEngine`` from asyncio: one dedicated thread runs the step loop.

The engine is single-threaded, so every engine call goes through ``call(fn)``: the function
is queued and runs on the engine thread between two steps (no locks around the engine).
A replica builds its engine with ``launch``, on that same thread: see ``launch`` for why.
A step's outputs cross to the event loop in ONE ``call_soon_threadsafe`` per step, whatever the
number of requests in it; on the loop they are sorted into per-request ``OutputStream`` queues.
The streams belong to the event loop alone (opened, fed and closed there). Runs without Ray.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from cluster.config import SamplingParams
from cluster.engine.llm_engine import LLMEngine, RemoteKVReservation, RequestOutput
from cluster.engine.request import RequestStatus
from cluster.engine.structured import RequestGrammar
from cluster.serving.messages import BatchGeometry, EngineStats

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDead(RuntimeError):
    """The engine thread stopped or failed under this request; it cannot finish."""


class RequestIdInUse(RuntimeError):
    """A stream is already open under this engine request id: the request that holds it keeps it."""


class OutputStream:
    """One request's outputs on the event loop, in order; ``get()`` raises what ended it abnormally."""

    __slots__ = ("request_id", "_queue")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def get_ready(self) -> list[RequestOutput]:
        """Outputs already here, without waiting (a consumer that fell behind writes them in one go).
        Stops before an error, which the next ``get()`` raises."""
        ready: list[RequestOutput] = []
        while not self._queue.empty():
            item = self._queue._queue[0]  # type: ignore[attr-defined]  # peek: leave an error for get()
            if isinstance(item, BaseException):
                break
            ready.append(self._queue.get_nowait())  # type: ignore[arg-type]
        return ready


#: How long a thread that wants the GIL waits before its holder is asked to drop it (CPython's default: 5 ms).
#: The engine thread drops the GIL in every torch and numba call and takes it back after, hundreds of times per
#: step; while the event loop's thread runs Python (streaming the last step's outputs, parsing requests), each
#: take-back can wait up to the interval.
GIL_SWITCH_INTERVAL_S = 0.0005


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        #: Event-loop side only.
        self._streams: dict[str, OutputStream] = {}
        self._stopped = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        self.step_seconds = 0.0
        self.step_cpu_seconds = 0.0
        self.geometry = BatchGeometry()

    @classmethod
    async def launch(cls, build: Callable[[], LLMEngine]) -> AsyncEngine:
        """Builds the engine with ``build()`` on a new thread and runs its step loop on that same thread.

        Every thread that runs a parallel torch op gets an OpenMP thread team of its own, and the team's
        workers stay for the thread's life. Once a process has more such workers than CPUs, libgomp stops
        letting them spin between parallel regions: each of the hundreds of regions in a step waits for its
        workers to be woken again. An engine built on one thread (weights loaded, kernels warmed up there)
        and stepped on another had made every served step about 1.3x dearer on a 2-core node than the same
        engine offline (``python -m bench.serve_vs_offline --rates 2``). Built here, the engine's thread is
        the only one of the process that computes."""
        loop = asyncio.get_running_loop()
        ready: Future[AsyncEngine] = Future()

        def engine_thread() -> None:
            _name_os_thread("engine-loop")  # before the first parallel region: its workers inherit the name
            try:
                engine = cls(build())
            except BaseException as e:  # handed to the awaiting caller  # noqa: BLE001
                ready.set_exception(e)
                return
            engine.loop, engine._thread = loop, threading.current_thread()
            ready.set_result(engine)
            engine._run()

        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # process-wide: the engine shares its process with a server
        threading.Thread(target=engine_thread, name="engine-loop", daemon=True).start()
        return await asyncio.wrap_future(ready)

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    # ---- calls from the event loop ---------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread between two steps and returns its result."""
        if not self.alive:
            raise EngineDead(f"engine is not running: {self._error!r}")
        fut: Future = Future()

        def command() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # handed to the awaiting caller  # noqa: BLE001
                    fut.set_exception(e)

        self._commands.put(command)
        return await asyncio.wrap_future(fut)

    def open_stream(self, request_id: str) -> OutputStream:
        """Where ``request_id``'s outputs go, from the next step on. Open it before the request enters the
        engine, so an output of the very next step is not missed; ``abort`` (or the last output) closes it.

        Raises ``RequestIdInUse`` while another stream is open under the id: replacing it would take the
        outputs of a request already accepted away from its client (callers make ids unique per request)."""
        if request_id in self._streams:
            raise RequestIdInUse(f"engine request id {request_id!r} is already streaming")
        stream = self._streams[request_id] = OutputStream(request_id)
        return stream

    async def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        hold_kv_on_finish: bool = False,
        stream: OutputStream | None = None,
        grammar: RequestGrammar | None = None,
    ) -> OutputStream:
        """Adds the request to the engine, its outputs going to ``stream`` (from ``open_stream(request_id)``) or,
        when None, to a stream opened here, which a failure here closes again. ``grammar``: the request's matcher
        from ``self.grammar(params)`` (built here when the request has a constraint and it is None)."""
        opened_here = stream is None
        if stream is None:
            stream = self.open_stream(request_id)
        elif self._streams.get(request_id) is not stream:
            raise ValueError(f"the stream given is not the one open for {request_id!r}")
        try:
            built = grammar or await self.grammar(params)
            await self.call(lambda e: e.add_request(request_id, prompt, params, hold_kv_on_finish, built))
        except BaseException:
            if opened_here and self._streams.get(request_id) is stream:
                del self._streams[request_id]
            raise
        return stream

    async def grammar(self, params: SamplingParams) -> RequestGrammar | None:
        """A fresh matcher for the request's output constraint (None without one), built on a worker thread:
        a large grammar takes seconds to build, which on the engine's thread would stall every request's steps
        (llguidance drops the GIL while it builds). InvalidRequestError when it cannot be used."""
        if params.structured is None:
            return None
        return await asyncio.to_thread(self.engine.grammars.matcher, params.structured)

    # The engine's disaggregation calls, run on the engine thread (``LLMEngine`` has their contracts).

    async def reserve_remote_kv(
        self, request_id: str, prompt: list[int], params: SamplingParams, grammar: RequestGrammar | None = None
    ) -> RemoteKVReservation | None:
        return await self.call(lambda e: e.reserve_remote_kv(request_id, prompt, params, grammar))

    async def complete_remote_kv(
        self,
        request_id: str,
        first_token_id: int,
        first_logprob: float | None,
        first_top_logprobs: tuple[tuple[int, float], ...] = (),
    ) -> None:
        await self.call(lambda e: e.complete_remote_kv(request_id, first_token_id, first_logprob, first_top_logprobs))

    async def fallback_to_local_prefill(self, request_id: str) -> None:
        await self.call(lambda e: e.fallback_to_local_prefill(request_id))

    async def held_kv_blocks(self, request_id: str) -> list[int]:
        return await self.call(lambda e: e.held_kv_blocks(request_id))

    def abort(self, request_id: str) -> None:
        """Closes the request's stream and frees its blocks at the next engine turn. Idempotent; never
        blocks; safe after finish."""
        self._streams.pop(request_id, None)
        self._commands.put(lambda: self.engine.abort_request(request_id))

    # ---- the event loop's side of a step ---------------------------------------------------

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        """One step's outputs, sorted into their streams (runs on the event loop, once per step)."""
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if out.finished:
                del streams[out.request_id]
            stream.put(out)

    def _fail_streams(self, request_ids: Sequence[str] | None, error: BaseException) -> None:
        """Ends these streams (all when None) with ``error`` (event loop)."""
        ids = list(self._streams) if request_ids is None else request_ids
        for rid in ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(error)

    # ---- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        _name_os_thread("engine-loop")
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
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self._fail_streams, None, EngineDead(f"engine step failed: {e!r}"))

    def _recover(self, error: Exception) -> None:
        """Ends every request in the engine with an error (their state may be half-updated) and keeps the
        loop going if the block pool is whole afterwards; raises when it is not."""
        log.exception("engine step failed; ending the %d requests in the engine", len(self.engine.requests))
        ids = list(self.engine.requests)
        for rid in ids:
            self.engine.abort_request(rid)
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._fail_streams, ids, EngineDead(f"engine step failed: {error!r}"))
        self.engine.block_pool.check_integrity()  # AssertionError: the pool is corrupt, the loop must end

    def _drain_commands(self, block: bool) -> None:
        # Idle, the thread sleeps until a command comes (``shutdown`` sends one): no timed wake-ups, which on a
        # small machine land on the cores another process computes on.
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
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
        wall, cpu = time.perf_counter(), time.thread_time()
        outputs = e.step()
        self.step_seconds += time.perf_counter() - wall
        self.step_cpu_seconds += time.thread_time() - cpu
        self.num_steps += 1
        self.geometry = self._geometry(before)
        if outputs:
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self._deliver, outputs)

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

    def stats(self) -> EngineStats:
        e = self.engine
        sched = e.scheduler
        pool = e.block_pool
        queued = list(sched.waiting) + list(sched.running)
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting) + len(sched.remote),
            waiting_for_remote_kv=len(sched.remote),
            held_kv_requests=sum(1 for r in list(e.requests.values()) if r.is_finished),
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_free=pool.num_free_blocks,
            kv_dtype=e.kv_layout.dtype,
            prefix_queries=pool.num_cache_queries,
            prefix_hits=pool.num_cache_hits,
            preemptions=sched.num_preemptions,
            steps=self.num_steps,
            step_seconds=self.step_seconds,
            step_cpu_seconds=self.step_cpu_seconds,
            queued_prefill_tokens=sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in queued),
            active_requests=len(e.requests),
            geometry=self.geometry,
        )

    async def check_integrity(self) -> bool:
        def check(e: LLMEngine) -> bool:
            try:
                e.block_pool.check_integrity()
                return True
            except AssertionError:
                return False

        return await self.call(check)


def _name_os_thread(name: str) -> None:
    """Gives the calling thread ``name`` in the OS (Linux: /proc/<pid>/task/<tid>/comm, top -H, perf), where
    every thread of a Ray worker is otherwise called by the process title. Threads it starts later (torch's
    OpenMP workers) inherit the name, so the engine's whole CPU shows under it (bench/replica_threads.py)."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
