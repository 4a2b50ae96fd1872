"""The prefill pool replica: batches prompts, produces the first token and the prompt's KV blocks.

A ``PrefillTask`` runs as an ordinary engine request with ``max_tokens=1`` and
``hold_kv_on_finish=True`` (chunked prefill and the prefix cache come from the engine); when
its first token is sampled, the prompt's blocks past ``skip_blocks`` are handed over (as a
Ray object in the result, or pushed into the decode side's lease by kv_transfer) and released.
Every exit path (deadline, cancellation by the decode replica, failure) frees the blocks:
``release_kv``/``abort`` are idempotent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time

from ray import serve

from cluster.serving.async_engine import AsyncEngine, next_output
from cluster.engine.llm_engine import LLMEngine
from cluster.serving.replica_lifecycle import report_stats_forever, stop_replica
from cluster.serving.metrics import ReplicaStats
from cluster.serving.config import ServeConfig
from cluster.serving.messages import PrefillResult, PrefillTask
from kv_transfer import KVSender, KVTransferConfig, LeaseState, PagedKV

log = logging.getLogger("ray.serve")


def replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (unit use)  # noqa: BLE001
        return "local"


class PrefillWorker:
    async def __init__(self, config: ServeConfig, model_dir: str, board=None):
        self.config = config
        self.replica_id = replica_id()
        engine = await asyncio.to_thread(LLMEngine, config.engine_config("prefill", model_dir))
        self.engine = AsyncEngine(engine)
        self.engine.start(asyncio.get_running_loop())
        self.board = board
        self.sender: KVSender | None = None
        if config.transport != "ray":
            # The sender releases the source blocks exactly once; abort is idempotent, so the
            # finally in ``prefill`` releasing them too is harmless.
            self.sender = KVSender(
                PagedKV(engine.kv_cache),
                release=lambda rid, _ids: self.engine.abort(rid),
                config=KVTransferConfig(
                    transport=config.transport, lease_ttl_s=config.timeouts.prefill_timeout_s + 2.0
                ),
            )
        self._counters = {"transfers": 0, "transfer_bytes": 0, "transfer_seconds": 0.0, "transfer_failures": 0}
        self._integrity_ok: bool | None = None
        self._last_transport = ""
        self._reporter = asyncio.get_running_loop().create_task(
            report_stats_forever(self.engine, board, self.stats, self._set_integrity, self.config.routing_stats_period_s)
        ) if board is not None else None

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        """Prefills ``task`` and hands over its KV. Raises TimeoutError past the task's deadline."""
        rid = task.request_id
        params = dataclasses.replace(task.params, max_tokens=1, stop=(), ignore_eos=True)
        try:
            return await asyncio.wait_for(
                self._prefill(rid, task, params), timeout=max(0.0, task.deadline - time.time())
            )
        except Exception:  # not CancelledError: the decode side giving up is no failure here
            self._counters["transfer_failures"] += 1
            raise
        finally:
            if task.lease is not None and self.sender is not None:
                # Stops an in-flight send from gathering blocks we are about to free (local, no RPC:
                # the decode replica ends its side of the lease itself). No-op after a completed send.
                self.sender.leases.end(task.lease.lease_id, LeaseState.ABORTED, "prefill ended")
            self.engine.abort(rid)  # idempotent: releases held blocks on every path

    async def _prefill(self, rid: str, task: PrefillTask, params) -> PrefillResult:
        q = await self.engine.add_request(rid, list(task.prompt_token_ids), params, hold_kv_on_finish=True)
        out = await next_output(q)
        while not out.finished:  # max_tokens=1: the first output is the last
            out = await next_output(q)
        if out.error is not None:  # the decode side retries elsewhere or prefills locally
            raise RuntimeError(f"prefill of {rid} failed in the engine: {out.error}")
        t0 = time.perf_counter()

        first = out.new_token_ids[0]
        if task.lease is not None and self.sender is not None:
            ids = await self.engine.call(lambda e: e.held_kv_blocks(rid)[task.lease.first_block :])
            # Blocking (bounded by the lease deadline): gathers held blocks, pushes, completes the lease.
            sent = await asyncio.to_thread(self.sender.send, task.lease, ids, first_token_id=first)
            kv, n, nbytes = None, sent.num_blocks, sent.nbytes
            self._last_transport = sent.transport
        else:

            def gather(e: LLMEngine):
                ids = e.held_kv_blocks(rid)[task.skip_blocks :]
                return e.kv_cache[:, :, ids].clone(), len(ids)

            kv, n = await self.engine.call(gather)
            nbytes = kv.numel() * kv.element_size()
            self._last_transport = "ray"
        self._counters["transfers"] += 1
        self._counters["transfer_bytes"] += nbytes
        self._counters["transfer_seconds"] += time.perf_counter() - t0
        first_lp = out.new_logprobs[0] if out.new_logprobs else None
        return PrefillResult(rid, first, first_lp, self.replica_id, n, nbytes, kv.cpu() if kv is not None else None)

    # ---- stats --------------------------------------------------------------------------

    def stats(self) -> ReplicaStats:
        snap = self.engine.snapshot()
        return ReplicaStats(
            pool="prefill",
            replica_id=self.replica_id,
            healthy=self.engine.alive,
            pid=os.getpid(),
            integrity_ok=self._integrity_ok,
            last_transport=self._last_transport,
            **snap,
            **self._counters,
        )

    def record_routing_stats(self) -> dict:
        s = self.stats()
        return {
            "queued_prefill_tokens": s.queued_prefill_tokens,
            "kv_blocks_free": s.kv_blocks_free,
            "running": s.running,
        }

    def record_autoscaling_stats(self) -> dict:
        return {"queued_prefill_tokens": float(self.stats().queued_prefill_tokens)}

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("prefill engine loop is not running")

    def _set_integrity(self, ok: bool) -> None:
        self._integrity_ok = ok

    def shutdown(self) -> None:
        """Stops the KV sender (in-flight sends end) and the engine thread. Idempotent."""
        stop_replica(getattr(self, "_reporter", None), getattr(self, "sender", None), getattr(self, "engine", None))

    def __del__(self):
        self.shutdown()
