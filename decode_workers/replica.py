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
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve

from cluster.serving.async_engine import AsyncEngine, next_output
from cluster.dtypes import torch_dtype
from cluster.engine.llm_engine import LLMEngine, RemoteKVReservation, RequestOutput
from cluster.serving.replica_lifecycle import report_stats_forever, stop_replica
from cluster.serving.metrics import ReplicaStats
from cluster.serving.config import ServeConfig
from cluster.serving.messages import GenerateTask, PrefillResult, PrefillTask, Started
from kv_transfer import KVReceiver, KVTransferConfig, Lease, PagedKV, Reservation

log = logging.getLogger("ray.serve")


def replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve  # noqa: BLE001
        return "local"


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        return "127.0.0.1"


class PrefillFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class _Slot:
    """Where a remote prefill's KV goes: blocks past the local prefix hits, and their lease (if kv_transfer)."""

    skip_blocks: int
    block_ids: tuple[int, ...]
    lease: Lease | None


class EngineThreadReserver:
    """kv_transfer ``BlockReserver`` for an engine driven by ``AsyncEngine``.

    ``reserve`` runs on the engine thread only (``open_lease`` is called from an engine call; a
    peer-initiated OpenLease from a gRPC thread gets None). A retry re-uses the reservation. The
    lease's end changes nothing here (``commit``/``free`` are no-ops): the request's owner,
    ``DecodeWorker.generate``, completes it, retries, prefills locally or aborts it, and it ends
    every lease before touching the blocks again.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.engine_thread: threading.Thread | None = None
        self._reservations: dict[str, RemoteKVReservation] = {}

    def reserve(self, request_id: str, num_blocks: int, prompt_token_ids, context) -> Reservation | None:
        if self.engine_thread is not None and threading.current_thread() is not self.engine_thread:
            return None
        r = self._reservations.get(request_id)
        if r is None:
            r = self.engine.reserve_remote_kv(request_id, list(prompt_token_ids), context)
            if r is None:
                return None
            self._reservations[request_id] = r
        skip = r.num_cached_tokens // self.engine.kv_layout.block_size
        return Reservation(tuple(r.block_ids[skip:]), skip)

    def commit(self, request_id: str, block_ids, first_token_id) -> None:
        pass

    def free(self, request_id: str, block_ids) -> None:
        pass

    def forget(self, request_id: str) -> None:
        self._reservations.pop(request_id, None)


class DecodeWorker:
    async def __init__(self, config: ServeConfig, model_dir: str, prefill=None, board=None):
        self.config = config
        self.replica_id = replica_id()
        engine = await asyncio.to_thread(LLMEngine, config.engine_config("decode", model_dir))
        self.engine = AsyncEngine(engine)
        self.engine.start(asyncio.get_running_loop())
        self.prefill = prefill
        self.board = board
        self.reserver = EngineThreadReserver(engine)
        self.receiver: KVReceiver | None = None
        self._leases: dict[str, Lease] = {}
        if config.transport != "ray":
            sink = PagedKV(engine.kv_cache)
            kv_cfg = KVTransferConfig(
                transport=config.transport,
                host=config.kv_transfer_host or _node_ip(),
                lease_ttl_s=config.timeouts.prefill_timeout_s + 2.0,
            )
            self.receiver = await asyncio.to_thread(KVReceiver(sink, self.reserver, kv_cfg).start)
        self.reserver.engine_thread = self.engine.thread
        self._counters = {
            "transfers": 0,
            "transfer_bytes": 0,
            "transfer_seconds": 0.0,
            "transfer_failures": 0,
            "prefill_retries": 0,
            "local_fallbacks": 0,
        }
        self._integrity_ok: bool | None = None
        self._reporter = asyncio.get_running_loop().create_task(
            report_stats_forever(self.engine, board, self.stats, self._set_integrity, self.config.routing_stats_period_s)
        ) if board is not None else None

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
            self._end_lease(rid)  # before the blocks are freed: no late write can land in them
            self.reserver.forget(rid)
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
            slot, q = await self.engine.call_with_stream(lambda e: self._reserve(e, rid, prompt, task.params), rid)
            if slot is not None or time.time() >= give_up:
                break
            await asyncio.sleep(0.02)
        if slot is None:  # no room for a lease: the scheduler queues it for a local prefill instead
            self._counters["local_fallbacks"] += 1
            q = await self.engine.add_request(rid, prompt, task.params)
            yield Started("local", self.replica_id)
            async for out in self._drain(q, task):
                yield out
            return
        yield Started("remote", self.replica_id)
        result, slot = await self._prefill_with_retries(task, slot)
        self._end_lease(rid)  # no-op after a completed transfer; stops a late sender otherwise
        if result is None:
            self._counters["local_fallbacks"] += 1
            await self.engine.call(lambda e: self._fallback(e, rid))
        else:
            await self.engine.call(lambda e: self._install(e, rid, slot, result))
        async for out in self._drain(q, task):
            yield out

    # Engine-thread helpers (run through ``self.engine.call``).

    def _reserve(self, e: LLMEngine, rid: str, prompt: list[int], params) -> _Slot | None:
        """Destination blocks for the prompt past our prefix-cache hits, as a kv_transfer lease or as
        plain block ids (Ray data plane). Called again for a retry: the same blocks, a new lease."""
        if self.receiver is not None:
            lease = self.receiver.open_lease(
                rid, prompt_token_ids=prompt, context=params, ttl_s=self.config.timeouts.prefill_timeout_s + 2.0
            )
            if lease is None:
                return None
            self._leases[rid] = lease
            return _Slot(lease.first_block, lease.block_ids, lease)
        res = self.reserver.reserve(rid, 0, prompt, params)
        return None if res is None else _Slot(res.first_block, res.block_ids, None)

    def _install(self, e: LLMEngine, rid: str, slot: _Slot, result: PrefillResult) -> None:
        if result.kv is not None:
            e.kv_cache[:, :, list(slot.block_ids)] = result.kv.to(e.kv_cache.device)
        self.reserver.forget(rid)
        e.complete_remote_kv(rid, result.first_token_id, result.first_logprob)

    def _fallback(self, e: LLMEngine, rid: str) -> None:
        self.reserver.forget(rid)
        e.fallback_to_local_prefill(rid)

    def _end_lease(self, rid: str) -> None:
        """Ends the request's open lease, if any (idempotent): after it returns no sender writes into its blocks."""
        lease = self._leases.pop(rid, None)
        if lease is not None and self.receiver is not None:
            self.receiver.abort(lease.lease_id, "the decode replica gave up on this transfer")

    async def _prefill_with_retries(self, task: GenerateTask, slot: _Slot) -> tuple[PrefillResult | None, _Slot]:
        """The prefill replica's result (KV checked against our layout) and the slot it filled; None: prefill
        locally. A retry goes to another prefill replica with a fresh lease on the same blocks."""
        attempts = self.config.timeouts.max_prefill_attempts
        for attempt in range(attempts):
            if attempt > 0:
                self._counters["prefill_retries"] += 1
                self._end_lease(task.request_id)
                slot = await self.engine.call(
                    lambda e: self._reserve(e, task.request_id, list(task.prompt_token_ids), task.params)
                )
            deadline = min(task.deadline, time.time() + self.config.timeouts.prefill_timeout_s)
            ptask = PrefillTask(
                task.request_id,
                task.prompt_token_ids,
                task.params,
                slot.skip_blocks,
                deadline,
                task.block_hashes,
                attempt,
                slot.lease,
            )
            t0 = time.perf_counter()
            resp = self.prefill.prefill.remote(ptask)
            try:
                result: PrefillResult = await asyncio.wait_for(resp, timeout=max(0.0, deadline - time.time()))
                self._check_kv(result, len(slot.block_ids))
            except asyncio.CancelledError:
                resp.cancel()
                raise
            except Exception as e:  # dead replica, deadline, bad KV: this attempt failed before the first token  # noqa: BLE001
                resp.cancel()
                self._counters["transfer_failures"] += 1
                log.warning("prefill of %s failed (attempt %d/%d): %r", task.request_id, attempt + 1, attempts, e)
                continue
            self._counters["transfers"] += 1
            self._counters["transfer_bytes"] += result.num_bytes
            self._counters["transfer_seconds"] += time.perf_counter() - t0
            return result, slot
        return None, slot

    def _check_kv(self, result: PrefillResult, num_blocks: int) -> None:
        if result.kv is None:
            return  # kv_transfer pushed it into the lease (both sides checked the layout)
        layout = self.engine.engine.kv_layout
        want = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        if tuple(result.kv.shape) != want or result.kv.dtype != torch_dtype(layout.dtype):
            raise PrefillFailed(
                f"KV from the prefill replica has shape {tuple(result.kv.shape)} {result.kv.dtype}, "
                f"want {want} {layout.dtype}"
            )

    # ---- stats ------------------------------------------------------------------------------

    def stats(self) -> ReplicaStats:
        return ReplicaStats(
            pool="decode",
            replica_id=self.replica_id,
            healthy=self.engine.alive,
            pid=os.getpid(),
            integrity_ok=self._integrity_ok,
            **self.engine.snapshot(),
            **self._counters,
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

    def _set_integrity(self, ok: bool) -> None:
        self._integrity_ok = ok

    def shutdown(self) -> None:
        """Stops the KV receiver (open leases end) and the engine thread. Idempotent."""
        stop_replica(getattr(self, "_reporter", None), getattr(self, "receiver", None), getattr(self, "engine", None))

    def __del__(self):
        self.shutdown()
