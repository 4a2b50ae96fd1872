"""The decode pool replica: owns a request from arrival to its last token.

LOCAL: the request enters the engine as is (the engine prefills it here).
REMOTE: reserve blocks for the prompt (a lease), ask a prefill replica to prefill and hand
over the KV of the blocks past our own prefix-cache hits, write them in place, then
``complete_remote_kv(first_token)`` and decode on. Before the first token a failed, slow or
dead prefill replica costs a retry on another prefill replica, then a local prefill
(``fallback_to_local_prefill``); it never hangs or kills this replica. Every exit (finish,
deadline, client disconnect = cancellation of ``generate``) ends in ``abort``, which is
idempotent and frees the request's blocks.
"""

from __future__ import annotations

import asyncio
import os
import logging
import time
from collections.abc import AsyncIterator

from ray import serve

from cluster.async_engine import AsyncEngine, next_output
from cluster.engine.llm_engine import LLMEngine, RequestOutput
from cluster.engine.kv_cache import torch_dtype
from cluster.metrics import ReplicaStats
from cluster.serve_config import ServeConfig
from cluster.serve_types import GenerateTask, PrefillResult, PrefillTask, Started

log = logging.getLogger("ray.serve")


def replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve
        return "local"


class PrefillFailed(RuntimeError):
    pass


class DecodeWorker:
    async def __init__(self, config: ServeConfig, model_dir: str, prefill=None, board=None):
        self.config = config
        self.replica_id = replica_id()
        engine = await asyncio.to_thread(LLMEngine, config.engine_config("decode", model_dir))
        self.engine = AsyncEngine(engine)
        self.engine.start(asyncio.get_running_loop())
        self.prefill = prefill
        self.board = board
        self._healthy_prefill: tuple[str, ...] | None = None
        self._counters = {
            "transfers": 0,
            "transfer_bytes": 0,
            "transfer_seconds": 0.0,
            "transfer_failures": 0,
            "prefill_retries": 0,
            "local_fallbacks": 0,
        }
        self._integrity_ok: bool | None = None
        self._reporter = asyncio.get_running_loop().create_task(self._report_loop()) if board is not None else None

    # ---- the request ----------------------------------------------------------------------

    async def generate(self, task: GenerateTask) -> AsyncIterator[Started | RequestOutput]:
        rid = task.request_id
        try:
            if task.route == "remote" and self.prefill is not None:
                async for item in self._remote(task):
                    yield item
                    if isinstance(item, RequestOutput) and item.finished:
                        return
                return
            q = await self.engine.add_request(rid, list(task.prompt_token_ids), task.params)
            yield Started("local", self.replica_id)
            async for out in self._drain(q, task):
                yield out
        finally:
            self.engine.abort(rid)

    async def _drain(self, q: asyncio.Queue, task: GenerateTask) -> AsyncIterator[RequestOutput]:
        while True:
            left = task.time_left()
            if left <= 0:
                raise TimeoutError(f"request {task.request_id} passed its deadline")
            out = await asyncio.wait_for(next_output(q), timeout=left)
            yield out
            if out.finished:
                return

    async def _remote(self, task: GenerateTask) -> AsyncIterator[Started | RequestOutput]:
        rid, prompt = task.request_id, list(task.prompt_token_ids)
        give_up = time.time() + self.config.timeouts.reserve_timeout_s
        while True:
            res = await self.engine.call(lambda e: e.reserve_remote_kv(rid, prompt, task.params), stream_id=rid)
            if res is not None or time.time() >= give_up:
                break
            await asyncio.sleep(0.02)
        if res is None:  # no room for a lease: the scheduler queues it for a local prefill instead
            self._counters["local_fallbacks"] += 1
            q = await self.engine.add_request(rid, prompt, task.params)
            yield Started("local", self.replica_id)
            async for out in self._drain(q, task):
                yield out
            return
        q = self.engine.stream(rid)
        yield Started("remote", self.replica_id)
        bs = self.engine.engine.kv_layout.block_size
        skip = res.num_cached_tokens // bs
        result = await self._prefill_with_retries(task, skip)
        if result is None:
            self._counters["local_fallbacks"] += 1
            await self.engine.call(lambda e: e.fallback_to_local_prefill(rid))
        else:
            dst = list(res.block_ids[skip:])

            def install(e: LLMEngine) -> None:
                if result.kv is not None:
                    e.kv_cache[:, :, dst] = result.kv.to(e.kv_cache.device)
                e.complete_remote_kv(rid, result.first_token_id, result.first_logprob)

            await self.engine.call(install)
        async for out in self._drain(q, task):
            yield out

    async def _prefill_with_retries(self, task: GenerateTask, skip: int) -> PrefillResult | None:
        """The prefill replica's result with KV checked against our layout, or None: prefill locally."""
        attempts = self.config.timeouts.max_prefill_attempts
        for attempt in range(attempts):
            if attempt > 0:
                self._counters["prefill_retries"] += 1
            deadline = min(task.deadline, time.time() + self.config.timeouts.prefill_timeout_s)
            ptask = PrefillTask(
                task.request_id, task.prompt_token_ids, task.params, skip, deadline, task.block_hashes, attempt
            )
            t0 = time.perf_counter()
            resp = self.prefill.prefill.remote(ptask)
            try:
                result: PrefillResult = await asyncio.wait_for(resp, timeout=max(0.0, deadline - time.time()))
                self._check_kv(result, len(task.prompt_token_ids), skip)
            except asyncio.CancelledError:
                resp.cancel()
                raise
            except Exception as e:  # dead replica, deadline, bad KV: this attempt failed before the first token
                resp.cancel()
                self._counters["transfer_failures"] += 1
                log.warning("prefill of %s failed (attempt %d/%d): %r", task.request_id, attempt + 1, attempts, e)
                continue
            self._counters["transfers"] += 1
            self._counters["transfer_bytes"] += result.num_bytes
            self._counters["transfer_seconds"] += time.perf_counter() - t0
            return result
        return None

    def _check_kv(self, result: PrefillResult, num_prompt_tokens: int, skip: int) -> None:
        layout = self.engine.engine.kv_layout
        n = -(-num_prompt_tokens // layout.block_size) - skip
        if result.kv is None:
            return  # pushed by kv_transfer into the lease
        want = (layout.num_layers, 2, n, layout.block_size, layout.num_kv_heads, layout.head_dim)
        if tuple(result.kv.shape) != want or result.kv.dtype != torch_dtype(layout.dtype):
            raise PrefillFailed(f"KV from the prefill replica has shape {tuple(result.kv.shape)} {result.kv.dtype}, want {want} {layout.dtype}")

    # ---- stats ------------------------------------------------------------------------------

    def stats(self) -> ReplicaStats:
        return ReplicaStats(
            pool="decode", replica_id=self.replica_id, healthy=self.engine.alive, pid=os.getpid(),
            integrity_ok=self._integrity_ok, **self.engine.snapshot(), **self._counters
        )

    def record_routing_stats(self) -> dict:
        s = self.stats()
        return {
            "kv_blocks_free": s.kv_blocks_free,
            "kv_blocks_total": s.kv_blocks_total,
            "running": s.running,
            "waiting": s.waiting,
            "batch_tokens": s.geometry.num_tokens,
        }

    def record_autoscaling_stats(self) -> dict:
        s = self.stats()
        return {"kv_usage": s.kv_usage, "running_seqs": float(s.running)}

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("decode engine loop is not running")

    async def _report_loop(self) -> None:
        while True:
            try:
                if self.engine.engine.kv_layout.num_blocks <= 16384:
                    self._integrity_ok = await self.engine.check_integrity()
                await self.board.report.remote(self.stats())
            except Exception as e:
                log.debug("stats report failed: %r", e)
            await asyncio.sleep(self.config.routing_stats_period_s)

    def __del__(self):
        eng = getattr(self, "engine", None)
        if eng is not None:
            eng.shutdown()

