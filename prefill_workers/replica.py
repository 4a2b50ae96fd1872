"""The prefill pool replica: batches prompts, produces the first token and pushes the prompt's KV.

A ``PrefillTask`` runs as an ordinary engine request with ``max_tokens=1`` and
``hold_kv_on_finish=True`` (chunked prefill and the prefix cache come from the engine); when
its first token is sampled, the prompt's blocks past ``lease.first_block`` are pushed into the
decode replica's lease by kv_transfer and released. Every exit path (deadline, cancellation by
the decode replica, failure) frees the blocks: ``abort`` is idempotent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

from cluster.engine.llm_engine import LLMEngine
from cluster.serving import tracing
from cluster.serving.async_engine import AsyncEngine
from cluster.serving.config import ServeConfig
from cluster.serving.messages import (
    PrefillAutoscalingStats,
    PrefillResult,
    PrefillRoutingStats,
    PrefillTask,
    ReplicaStats,
    TransferCounters,
)
from cluster.serving.replica_lifecycle import ReplicaReporter, seconds_since_process_start, transfer_config
from kv_transfer import KVSender, LeaseState, PagedKV

log = logging.getLogger("ray.serve")


class PrefillWorker:
    """Use ``await PrefillWorker.start(...)``; Serve's deployment class (``cluster.app``) wraps it."""

    def __init__(self, config: ServeConfig, engine: AsyncEngine, replica_id: str):
        self.config = config
        self.engine = engine
        self.replica_id = replica_id
        # No release callback: the finally in ``prefill`` frees the source blocks on every path, by the engine
        # request id of that one attempt (a send the deadline abandoned on its thread must not free a retry's).
        self.sender = KVSender(PagedKV(engine.engine.kv_cache), config=transfer_config(config))
        self.counters = TransferCounters()
        #: Prompt tokens prefilled (with the engine's busy seconds: this replica's measured throughput).
        self.prompt_tokens = 0
        #: Seconds from this process's start to the end of ``start`` (measured there).
        self.startup_s = 0.0
        self.reporter: ReplicaReporter | None = None

    @classmethod
    async def start(
        cls, config: ServeConfig, model_dir: str, board=None, replica_id: str = "local", num_threads: int | None = None
    ) -> PrefillWorker:
        engine_config = config.engine_config("prefill", model_dir, num_threads)
        engine = await AsyncEngine.launch(lambda: LLMEngine(engine_config))  # built on its own thread: see launch
        worker = cls(config, engine, replica_id)
        if board is not None:
            worker.reporter = ReplicaReporter.start(engine, board, worker.stats, config.routing_stats_period_s)
        worker.startup_s = seconds_since_process_start()
        return worker

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        """Prefills ``task`` and pushes its KV. Raises TimeoutError past the task's deadline."""
        engine_rid = engine_request_id(task)
        try:
            return await asyncio.wait_for(
                self._prefill(task, engine_rid), timeout=max(0.0, task.deadline - time.time())
            )
        except Exception:  # not CancelledError: the decode side giving up is no failure here
            self._count(transfer_failures=self.counters.transfer_failures + 1)
            raise
        finally:
            # Stops an in-flight send from gathering blocks we are about to free, and refuses one that has not
            # begun yet (local, no RPC: the decode replica ends its side of the lease itself). No-op after a
            # completed send.
            self.sender.leases.end(task.lease.lease_id, LeaseState.ABORTED, "prefill ended", refuse_if_not_begun=True)
            self.engine.abort(engine_rid)  # idempotent: releases held blocks on every path

    async def _prefill(self, task: PrefillTask, rid: str) -> PrefillResult:
        """``rid``: this attempt's engine request id (``engine_request_id``)."""
        arrived_ns = time.time_ns()
        params = dataclasses.replace(task.params, max_tokens=1, stop=(), ignore_eos=True)
        stream = await self.engine.add_request(rid, list(task.prompt_token_ids), params, hold_kv_on_finish=True)
        out = await stream.get()  # max_tokens=1: the first output is the last
        computed_ns = time.time_ns()
        if out.first_scheduled_at is not None:
            scheduled_ns = int(out.first_scheduled_at * 1e9)
            tracing.record("shapeserve.queue", task.trace_context, arrived_ns, scheduled_ns)
            prompt = {
                "shapeserve.prompt_tokens": out.num_prompt_tokens,
                "shapeserve.cached_tokens": out.num_cached_tokens,
            }
            tracing.record("shapeserve.prefill", task.trace_context, scheduled_ns, computed_ns, prompt, out.error)
        if out.error is not None:  # the decode side retries elsewhere or prefills locally
            raise RuntimeError(f"prefill of {rid} failed in the engine: {out.error}")
        self.prompt_tokens += len(task.prompt_token_ids)
        t0 = time.perf_counter()
        lease = task.lease
        ids = (await self.engine.held_kv_blocks(rid))[lease.first_block :]
        # Blocking (bounded by the lease deadline): gathers held blocks, pushes, completes the lease.
        transfer = tracing.start_child("shapeserve.kv_transfer", task.trace_context)
        try:
            sent = await asyncio.to_thread(self.sender.send, lease, ids)
        except BaseException as e:
            tracing.end(transfer, error=repr(e))
            raise
        tracing.end(
            transfer,
            attributes={
                "shapeserve.kv_transport": sent.transport,
                "shapeserve.kv_bytes": sent.nbytes,
                "shapeserve.kv_blocks": sent.num_blocks,
            },
        )
        c = self.counters
        self._count(
            transfers=c.transfers + 1,
            transfer_bytes=c.transfer_bytes + sent.nbytes,
            transfer_seconds=c.transfer_seconds + time.perf_counter() - t0,
            last_transport=sent.transport,
        )
        first_lp = out.new_logprobs[0] if out.new_logprobs else None
        first_top = out.new_top_logprobs[0] if out.new_top_logprobs else ()
        return PrefillResult(
            task.request_id,
            out.new_token_ids[0],
            first_lp,
            self.replica_id,
            sent.num_blocks,
            sent.nbytes,
            sent.transport,
            first_top_logprobs=first_top,
        )

    def _count(self, **changes) -> None:
        self.counters = dataclasses.replace(self.counters, **changes)

    # ---- stats --------------------------------------------------------------------------

    def stats(self) -> ReplicaStats:
        return ReplicaStats(
            pool="prefill",
            replica_id=self.replica_id,
            healthy=self.engine.alive,
            pid=os.getpid(),
            integrity_ok=self.reporter.integrity_ok if self.reporter else None,
            engine=self.engine.stats(),
            transfers=self.counters,
        )

    def routing_stats(self) -> PrefillRoutingStats:
        e = self.engine.stats()
        return PrefillRoutingStats(e.queued_prefill_tokens, e.kv_blocks_free, e.running)

    def autoscaling_stats(self) -> dict[str, float]:
        e = self.engine.stats()
        return PrefillAutoscalingStats(
            e.queued_prefill_tokens, self.prompt_tokens, e.step_seconds, self.startup_s
        ).as_dict()

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("prefill engine loop is not running")

    def shutdown(self) -> None:
        """Stops the stats reporter, the KV sender (in-flight sends end) and the engine thread. Idempotent."""
        if self.reporter is not None:
            self.reporter.stop()
        self.sender.close()
        self.engine.shutdown()


def engine_request_id(task: PrefillTask) -> str:
    """The id of one attempt's engine request here. A decode replica retries a failed prefill under the same
    request id, possibly on this same replica while the failed attempt's output, abort or send are still in
    flight; an id per attempt keeps each of those on its own attempt."""
    return f"{task.request_id}#attempt{task.attempt}"
