"""The decode pool replica: owns a request from arrival to its last token.

LOCAL: the request enters the engine as is (the engine prefills it here).
REMOTE: ``RemotePrefill`` reserves the prompt's blocks, has a prefill replica push their KV,
installs it, and the engine decodes on; before the first token a failed, slow or dead prefill
replica costs a retry on another prefill replica, then a local prefill. Every exit (finish,
deadline, client disconnect = cancellation of ``generate``) ends in ``abort``, which is
idempotent and frees the request's blocks.

The HTTP edge (``router``) runs in the same process and calls ``generate`` directly: outputs
reach it through the engine's per-request streams, with no hop between processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator

from cluster.engine.llm_engine import LLMEngine, RequestOutput
from cluster.serving.async_engine import AsyncEngine
from cluster.serving.config import ServeConfig
from cluster.serving.messages import (
    DecodeAutoscalingStats,
    DecodeRoutingStats,
    GenerateTask,
    ReplicaStats,
    Route,
    Started,
    TransferCounters,
)
from cluster.serving.replica_lifecycle import ReplicaReporter, transfer_config
from decode_workers.remote_prefill import PrefillOutcome, RemotePrefill
from decode_workers.request_spans import RequestSpans
from kv_transfer import KVReceiver, PagedKV

log = logging.getLogger("ray.serve")


class DecodeWorker:
    """Use ``await DecodeWorker.start(...)``; Serve's deployment class (``cluster.app``) wraps it."""

    def __init__(self, config: ServeConfig, engine: AsyncEngine, prefill, receiver: KVReceiver | None, replica_id: str):
        self.config = config
        self.engine = engine
        #: Handle of the prefill pool (``.prefill.remote(PrefillTask)``); None: every request prefills here.
        self.prefill = prefill
        self.receiver = receiver
        self.replica_id = replica_id
        self.block_size = engine.engine.kv_layout.block_size
        self.counters = TransferCounters()
        #: Prompt tokens of the REMOTE requests handed to the prefill pool (the class mix the autoscaler reads).
        self.remote_prompt_tokens = 0
        self.reporter: ReplicaReporter | None = None

    @classmethod
    async def start(
        cls,
        config: ServeConfig,
        model_dir: str,
        prefill=None,
        board=None,
        replica_id: str = "local",
        num_threads: int | None = None,
        kv_host: str | None = None,
    ) -> DecodeWorker:
        """Loads the engine (on its own thread, so the replica's event loop stays responsive) and, with a prefill
        pool, starts the KV receiver on ``kv_host``."""
        engine_config = config.engine_config("decode", model_dir, num_threads)
        engine = await AsyncEngine.launch(lambda: LLMEngine(engine_config))  # built on its own thread: see launch
        receiver = None
        if prefill is not None:
            host = config.kv_transfer_host or kv_host
            if host is None:
                raise RuntimeError("the decode replica needs an address for its KV receiver (kv_transfer_host)")
            receiver = KVReceiver(PagedKV(engine.engine.kv_cache), transfer_config(config, host))
            await asyncio.to_thread(receiver.start)
        worker = cls(config, engine, prefill, receiver, replica_id)
        if board is not None:
            worker.reporter = ReplicaReporter.start(engine, board, worker.stats, config.routing_stats_period_s)
        return worker

    # ---- the request ----------------------------------------------------------------------

    async def generate(self, task: GenerateTask) -> AsyncGenerator[Started | tuple[RequestOutput, ...], None]:
        """``Started`` once the request is in the engine, then its outputs, a batch at a time (all that arrived
        since the consumer last asked: one write to the client), until the finished one. Raises TimeoutError
        past the task's deadline; the request's blocks are freed however it ends."""
        rid = task.request_id
        stream = self.engine.open_stream(rid)
        deadline = asyncio.get_running_loop().call_later(
            max(0.0, task.time_left()), stream.put, TimeoutError(f"request {rid} passed its deadline")
        )
        remote = None
        if task.route is Route.REMOTE and self.prefill is not None and self.receiver is not None:
            timeouts = self.config.timeouts
            remote = RemotePrefill(task, self.engine, stream, self.receiver, self.prefill, timeouts, self.block_size)
        spans = RequestSpans(task.trace_context)
        try:
            if remote is not None and await remote.reserve():
                self.remote_prompt_tokens += len(task.prompt_token_ids)
                spans.waited_for_blocks()
                yield Started(Route.REMOTE, self.replica_id)
                await remote.run()
            else:
                if remote is None:
                    await self.engine.add_request(rid, list(task.prompt_token_ids), task.params, stream=stream)
                yield Started(Route.LOCAL, self.replica_id)
            while True:
                batch = (await stream.get(), *stream.get_ready())
                spans.outputs(batch)
                yield batch
                if batch[-1].finished:
                    return
        finally:
            spans.end()
            deadline.cancel()
            if remote is not None:
                remote.close()  # before the blocks are freed: no late write can land in them
                self._count(remote.outcome)
            self.engine.abort(rid)

    def _count(self, outcome: PrefillOutcome) -> None:
        c = self.counters
        self.counters = TransferCounters(
            transfers=c.transfers + outcome.transferred,
            transfer_bytes=c.transfer_bytes + outcome.transfer_bytes,
            transfer_seconds=c.transfer_seconds + outcome.transfer_seconds,
            transfer_failures=c.transfer_failures + outcome.failures,
            last_transport=outcome.transport or c.last_transport,
            prefill_retries=c.prefill_retries + max(0, outcome.attempts - 1),
            local_fallbacks=c.local_fallbacks + (outcome.route is Route.LOCAL),
        )

    # ---- stats ------------------------------------------------------------------------------

    def stats(self) -> ReplicaStats:
        return ReplicaStats(
            pool="decode",
            replica_id=self.replica_id,
            healthy=self.engine.alive,
            pid=os.getpid(),
            integrity_ok=self.reporter.integrity_ok if self.reporter else None,
            engine=self.engine.stats(),
            transfers=self.counters,
        )

    def routing_stats(self) -> DecodeRoutingStats:
        e = self.engine.stats()
        return DecodeRoutingStats(e.kv_blocks_free, e.kv_blocks_total, e.running, e.waiting, e.geometry.num_tokens)

    def autoscaling_stats(self) -> dict[str, float]:
        e = self.engine.stats()
        return DecodeAutoscalingStats(e.kv_usage, e.running, self.remote_prompt_tokens).as_dict()

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("decode engine loop is not running")

    def shutdown(self) -> None:
        """Stops the stats reporter, the KV receiver (open leases end) and the engine thread. Idempotent."""
        if self.reporter is not None:
            self.reporter.stop()
        if self.receiver is not None:
            self.receiver.close()
        self.engine.shutdown()
