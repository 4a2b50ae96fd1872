"""Replica choice for the two pools, as Serve custom request routers.

Replicas report plain numbers through ``record_routing_stats`` (Serve polls them every
``routing_stats_period_s``); the routers rank candidates with the pure functions below:

  decode  - KV headroom first (a replica that can hold the request's prompt + max_tokens
            blocks), then the load (running + waiting sequences, or the requests this router has
            in flight there if more), then tokens per step
  prefill - prefix affinity and queue together: the replica with the fewest tokens to
            compute = its queued prefill tokens + the prompt tokens it has not seen (block-hash
            overlap with what this router sent it, using ``hash_full_blocks``'s chained hashes);
            a retry (``attempt > 0``) avoids replicas that already had the request; ties go to
            the replica with fewer requests in flight from this router.

Routing stats are up to a period old, so between two polls every request would see the same
numbers and go to the same replica. Serve's own count of the requests this router has sent and
not yet seen finish (its queue-length cache, updated on every send and completion) is what keeps
a burst spread over the replicas.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, TypeVar

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.serving.messages import DecodeRoutingStats, GenerateTask, PrefillRoutingStats, PrefillTask

T = TypeVar("T")

# ---- pure ranking ------------------------------------------------------------------------


def rank_decode(
    stats: Sequence[DecodeRoutingStats], need_blocks: int, in_flight: Sequence[int] | None = None
) -> list[int]:
    """Indices of ``stats`` best first. Unknown stats (a fresh replica) count as empty. ``in_flight[i]``: requests
    this router has sent to replica ``i`` and not seen finish; both it and the reported sequences undercount the
    load (other routers' requests; requests sent since the report), so the larger one counts."""
    sent = in_flight if in_flight is not None else [0] * len(stats)

    def key(i: int):
        s = stats[i]
        total = max(s.kv_blocks_total, 1)
        fits = s.kv_blocks_free >= need_blocks
        load = max(s.running + s.waiting, sent[i])
        return (not fits, load, s.batch_tokens, -(s.kv_blocks_free - need_blocks) / total, i)

    return sorted(range(len(stats)), key=key)


def rank_prefill(
    stats: Sequence[PrefillRoutingStats],
    overlaps: Sequence[int],
    num_prompt_tokens: int,
    block_size: int,
    in_flight: Sequence[int] | None = None,
) -> list[int]:
    """Indices best first by tokens to compute: queued prefill tokens + this prompt's uncached part; then the
    longer cached prefix, then fewer requests in flight from this router (``in_flight[i]``)."""
    sent = in_flight if in_flight is not None else [0] * len(stats)

    def key(i: int):
        uncached = max(0, num_prompt_tokens - overlaps[i] * block_size)
        return (stats[i].queued_prefill_tokens + uncached, -overlaps[i], sent[i], i)

    return sorted(range(len(stats)), key=key)


def prefix_overlap(known: OrderedDict | None, block_hashes: Sequence[bytes]) -> int:
    """Leading blocks of ``block_hashes`` found in ``known``. Does not modify ``known``."""
    if not known:
        return 0
    n = 0
    for h in block_hashes:
        if h not in known:
            break
        n += 1
    return n


def _task(pending_request: PendingRequest | None, kind: type[T]) -> T | None:
    """The request's task when it is one of ``kind`` (HTTP requests forwarded by Serve's proxy are not)."""
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    return arg if isinstance(arg, kind) else None


# ---- Serve request routers -----------------------------------------------------------------


def _in_flight(router: RequestRouter, replicas: Sequence[RunningReplica]) -> list[int]:
    """Requests this router has in flight at each replica, from Serve's queue-length cache (0 when unknown)."""
    cache = router.replica_queue_len_cache
    return [cache.get(r.replica_id) or 0 for r in replicas]


class DecodeRequestRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, **kwargs: Any) -> None:
        self.block_size = block_size

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        # HTTP requests through Serve's proxy carry no task yet: rank by load alone.
        task = _task(pending_request, GenerateTask)
        need = -(-(len(task.prompt_token_ids) + task.params.max_tokens) // self.block_size) if task is not None else 1
        stats = [DecodeRoutingStats.from_dict(r.routing_stats) for r in candidate_replicas]
        order = rank_decode(stats, need, _in_flight(self, candidate_replicas))
        return [[candidate_replicas[i]] for i in order]


class PrefillRequestRouter(RequestRouter):
    def initialize_state(self, block_size: int = 16, max_blocks_per_replica: int = 65536, **kwargs: Any) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks_per_replica
        self._known: dict[str, OrderedDict[bytes, None]] = {}
        self._tried: OrderedDict[str, set[str]] = OrderedDict()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        task = _task(pending_request, PrefillTask)
        if task is None:
            return [candidate_replicas]
        candidates = candidate_replicas
        if task.attempt > 0:
            tried = self._tried.get(task.request_id, set())
            fresh = [r for r in candidates if r.replica_id.unique_id not in tried]
            candidates = fresh or candidates
        overlaps = [prefix_overlap(self._known.get(r.replica_id.unique_id), task.block_hashes) for r in candidates]
        stats = [PrefillRoutingStats.from_dict(r.routing_stats) for r in candidates]
        order = rank_prefill(stats, overlaps, len(task.prompt_token_ids), self.block_size, _in_flight(self, candidates))
        return [[candidates[i]] for i in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        task = _task(pending_request, PrefillTask)
        if task is None:
            return
        rid = replica_id.unique_id
        known = self._known.setdefault(rid, OrderedDict())
        for h in task.block_hashes:
            known[h] = None
            known.move_to_end(h)
        while len(known) > self.max_blocks:
            known.popitem(last=False)
        self._tried.setdefault(task.request_id, set()).add(rid)
        self._tried.move_to_end(task.request_id)
        while len(self._tried) > 10000:
            self._tried.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._known.pop(replica_id.unique_id, None)
