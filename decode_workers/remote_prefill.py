"""One REMOTE request's prefill on the decode side, owned by one object from reservation to the end.

    prefill = RemotePrefill(task, engine, receiver, prefill_pool, timeouts, block_size)
    try:
        if await prefill.reserve():          # blocks for the whole prompt, past our prefix-cache hits
            await prefill.run()              # attempts on prefill replicas; install the KV, or prefill locally
    finally:
        prefill.close()                      # ends the open lease (idempotent)
    prefill.outcome                          # what it took (route, attempts, bytes), for the replica's counters

``reserve()`` returns False when no blocks could be had in time: the request was added for a
local prefill instead. ``run()`` returns the route the request took (REMOTE when the pushed KV
was installed, LOCAL after falling back). The KV blocks are this request's (the engine reserved
them); a lease only promises them to one transfer, and it is always ended before the blocks are
used again: by the sender's completion, or here by ``abort`` before a retry, a fallback, or the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from cluster.engine.llm_engine import RemoteKVReservation
from cluster.serving import tracing
from cluster.serving.async_engine import AsyncEngine, OutputStream
from cluster.serving.config import TimeoutConfig
from cluster.serving.messages import GenerateTask, PrefillResult, PrefillTask, Route
from kv_transfer import KVReceiver, Lease, LeaseState

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class PrefillOutcome:
    """How one REMOTE request's prefill went."""

    route: Route = Route.REMOTE
    #: Tries on prefill replicas, and how many of them failed.
    attempts: int = 0
    failures: int = 0
    #: Whether a prefill replica's KV arrived (and was installed), its size and time.
    transferred: bool = False
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    transport: str = ""


class RemotePrefill:
    def __init__(
        self,
        task: GenerateTask,
        engine: AsyncEngine,
        stream: OutputStream,
        receiver: KVReceiver,
        prefill_pool: Any,
        timeouts: TimeoutConfig,
        block_size: int,
    ):
        self.task = task
        self.engine = engine
        #: The request's stream, opened by the caller: a local prefill's outputs go there too.
        self.stream = stream
        self.receiver = receiver
        #: Serve handle of the prefill pool: ``prefill_pool.prefill.remote(PrefillTask)``.
        self.prefill_pool = prefill_pool
        self.timeouts = timeouts
        self.block_size = block_size
        self.reservation: RemoteKVReservation | None = None
        self.lease: Lease | None = None
        self.outcome = PrefillOutcome()

    async def reserve(self) -> bool:
        """Reserves the prompt's blocks (waiting up to ``reserve_timeout_s`` for room). False: none could be
        had, and the request was added for a local prefill instead (queued like any LOCAL request)."""
        task = self.task
        rid, prompt = task.request_id, list(task.prompt_token_ids)
        give_up = time.time() + self.timeouts.reserve_timeout_s
        grammar = await self.engine.grammar(task.params)  # once: a refused reservation leaves it unused
        while True:
            self.reservation = await self.engine.reserve_remote_kv(rid, prompt, task.params, grammar)
            if self.reservation is not None:
                return True
            if time.time() >= give_up:
                break
            await asyncio.sleep(0.02)
        self.outcome = dataclasses.replace(self.outcome, route=Route.LOCAL)
        await self.engine.add_request(rid, prompt, task.params, stream=self.stream, grammar=grammar)
        return False

    async def run(self) -> Route:
        """Prefill attempts on the prefill pool, then the install of the first try that succeeds; without
        one, a local prefill on the same blocks (prefix hits kept). Returns the route taken."""
        for attempt in range(self.timeouts.max_prefill_attempts):
            result = await self._attempt(attempt)
            if result is not None:  # the KV is in place: decode continues after the prefill's first token
                await self.engine.complete_remote_kv(
                    self.task.request_id, result.first_token_id, result.first_logprob, result.first_top_logprobs
                )
                return Route.REMOTE
        self.outcome = dataclasses.replace(self.outcome, route=Route.LOCAL)
        await self.engine.fallback_to_local_prefill(self.task.request_id)
        return Route.LOCAL

    async def _attempt(self, attempt: int) -> PrefillResult | None:
        """One prefill replica's try with a fresh lease on our blocks; None if it failed (the lease is ended)."""
        task = self.task
        assert self.reservation is not None
        skip = self.reservation.num_cached_tokens // self.block_size
        lease = self.lease = self.receiver.open_lease(task.request_id, self.reservation.block_ids[skip:], skip)
        deadline = min(task.deadline, time.time() + self.timeouts.prefill_timeout_s)
        span = tracing.start_child("shapeserve.remote_prefill", task.trace_context, attributes={"attempt": attempt})
        ptask = PrefillTask(
            task.request_id,
            task.prompt_token_ids,
            task.params,
            deadline,
            lease,
            task.block_hashes,
            attempt,
            trace_context=tracing.context_of(span),
        )
        self.outcome = dataclasses.replace(self.outcome, attempts=attempt + 1)
        started = time.perf_counter()
        response = self.prefill_pool.prefill.remote(ptask)
        try:
            result: PrefillResult = await asyncio.wait_for(response, timeout=max(0.0, deadline - time.time()))
            ended = self.receiver.outcome(lease.lease_id)
            if ended is None or ended.state != LeaseState.COMPLETED:
                raise RuntimeError(f"the prefill replica answered but lease {lease.lease_id} is {ended}")
        except asyncio.CancelledError:
            response.cancel()
            tracing.end(span, error="cancelled")
            raise
        except Exception as e:  # dead replica, deadline, broken transfer: failed before the first token  # noqa: BLE001
            response.cancel()
            self.close()
            tracing.end(span, error=repr(e))
            self.outcome = dataclasses.replace(self.outcome, failures=self.outcome.failures + 1)
            log.warning(
                "prefill of %s failed (attempt %d/%d): %r",
                task.request_id,
                attempt + 1,
                self.timeouts.max_prefill_attempts,
                e,
            )
            return None
        self.lease = None  # completed: nothing left to end
        done = {"shapeserve.prefill_replica": result.replica_id, "shapeserve.kv_bytes": result.num_bytes}
        tracing.end(span, attributes=done)
        self.outcome = dataclasses.replace(
            self.outcome,
            transferred=True,
            transfer_bytes=result.num_bytes,
            transfer_seconds=time.perf_counter() - started,
            transport=result.transport,
        )
        return result

    def close(self) -> None:
        """Ends the open lease, if any: after this returns no sender writes into the blocks. Idempotent."""
        lease, self.lease = self.lease, None
        if lease is not None:
            self.receiver.abort(lease.lease_id, "the decode replica gave up on this transfer")
