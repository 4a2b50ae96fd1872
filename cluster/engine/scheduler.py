"""Token-budget continuous batching.

Each ``schedule()`` picks how many tokens every request computes this step, within
``max_num_batched_tokens``: running requests first (a decode is one token, an unfinished
prompt continues its chunk), then waiting requests in arrival order while blocks and budget
last. When a running request needs a block and none is free, the newest running request is
preempted by recompute (its blocks freed, it goes back to the head of the queue).

Only the scheduler changes a request's status, blocks and ``num_computed_tokens``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from cluster.config import CacheConfig, SchedulerConfig
from cluster.engine.block_pool import BlockPool
from cluster.engine.request import Request, RequestStatus
from cluster.prefix_hash import hash_block, hash_full_blocks


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    #: Tokens computed this step, starting at ``request.num_computed_tokens``.
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step ends at the request's last token, so a new token is sampled."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    #: Batch order: decodes (one token) first, then prefill chunks.
    scheduled: tuple[ScheduledRequest, ...]
    preempted_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, block_pool: BlockPool):
        self.config = sched
        self.block_size = cache.block_size
        self.pool = block_pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: Requests whose KV arrives from a prefill worker; they hold blocks but are not scheduled.
        self.remote: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- entry points ---------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def reserve_remote(self, request: Request) -> bool:
        """Allocates blocks for the whole prompt of a request whose KV will be pushed by a prefill
        worker, reusing local prefix-cache hits. Returns False (and changes nothing) if blocks are short."""
        hits = self._prefix_hits(request)
        new = self._allocate_after_hits(hits, self._blocks_needed(request.num_prompt_tokens) - len(hits))
        if new is None:
            return False
        request.block_ids = hits + new
        request.num_hashed_blocks = len(hits)
        request.num_cached_tokens = len(hits) * self.block_size
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote[request.request_id] = request
        return True

    def complete_remote(self, request: Request, first_token_id: int) -> None:
        """The prompt's KV is in place: the request decodes from here, after ``first_token_id``."""
        del self.remote[request.request_id]
        request.num_computed_tokens = request.num_prompt_tokens
        request.output_token_ids.append(first_token_id)
        request.status = RequestStatus.RUNNING
        self._cache_full_blocks(request)
        self.running.append(request)

    def fallback_to_local(self, request: Request) -> None:
        """The transfer failed before the first token: keep the prefix-cache hits, prefill the rest here."""
        del self.remote[request.request_id]
        keep = request.num_hashed_blocks
        self.pool.release(request.block_ids[keep:])
        request.block_ids = request.block_ids[:keep]
        request.num_computed_tokens = keep * self.block_size
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus, release_blocks: bool = True) -> None:
        """Removes a request from every queue. Idempotent."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request.request_id in self.remote:
            del self.remote[request.request_id]
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        request.status = status
        if release_blocks:
            self.release_blocks(request)

    def release_blocks(self, request: Request) -> None:
        if request.block_ids:
            self.pool.release(request.block_ids)
            request.block_ids = []
            request.num_hashed_blocks = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunk_cap = self.config.long_prefill_token_threshold or budget
        picked: dict[str, int] = {}
        preempted: list[str] = []

        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget, chunk_cap)
            while not self._grow(req, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                budget += picked.pop(victim.request_id, 0)
                if victim is req:
                    break
            else:
                picked[req.request_id] = n
                budget -= n

        # Admit new work only when nobody was preempted: blocks are short this step.
        deferred: list[Request] = []
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if self._wait_for_shared_prefix(req):
                deferred.append(self.waiting.popleft())
                continue
            # A request scoring its prompt computes every prompt position (a cached block has no logits).
            if req.num_computed_tokens == 0 and not req.block_ids and req.params.prompt_logprobs is None:
                hits = self._prefix_hits(req)
            else:
                hits = []
            start = len(hits) * self.block_size or req.num_computed_tokens
            n = min(req.num_tokens - start, budget, chunk_cap)
            new = self._allocate_after_hits(hits, self._blocks_needed(start + n) - len(hits) - len(req.block_ids))
            if new is None:
                break
            self.waiting.popleft()
            if hits:
                req.block_ids = hits
                req.num_hashed_blocks = len(hits)
                req.num_computed_tokens = start
            if hits and req.num_preemptions == 0:
                req.num_cached_tokens = len(hits) * self.block_size
            req.block_ids = req.block_ids + new
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_at is None:
                req.first_scheduled_at = time.time()
            self.running.append(req)
            picked[req.request_id] = n
            budget -= n

        self.waiting.extendleft(reversed(deferred))  # they keep their place at the head of the queue

        # One-token steps first: the attention backends run them as decodes (query length 1).
        by_id = {r.request_id: r for r in self.running}
        ordered = sorted(picked.items(), key=lambda item: item[1] != 1)
        return SchedulerOutput(tuple(ScheduledRequest(by_id[i], n) for i, n in ordered), tuple(preempted))

    def update_after_step(self, output: SchedulerOutput) -> None:
        """Advances ``num_computed_tokens`` and registers newly full blocks in the prefix cache.
        The engine appends sampled tokens afterwards."""
        for s in output.scheduled:
            s.request.num_computed_tokens += s.num_tokens
            self._cache_full_blocks(s.request)

    # ---- helpers ----------------------------------------------------------------------------

    def _blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _allocate_after_hits(self, hits: list[int], needed: int) -> list[int] | None:
        """References the prefix-cache hits first (so allocation cannot evict them), then allocates
        ``needed`` new blocks. On failure, gives the hits back and returns None."""
        self.pool.acquire_cached(hits)
        new = self.pool.allocate(needed) if needed > 0 else []
        if new is None:
            self.pool.release(hits)
        return new

    def _grow(self, req: Request, num_tokens: int) -> bool:
        needed = self._blocks_needed(num_tokens) - len(req.block_ids)
        if needed <= 0:
            return True
        new = self.pool.allocate(needed)
        if new is None:
            return False
        req.block_ids.extend(new)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.release_blocks(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _wait_for_shared_prefix(self, req: Request) -> bool:
        """True when a running request is still computing prompt blocks this new request shares: it waits (a step
        or a few) and then takes them from the prefix cache instead of computing them again. This is how the
        ``n`` choices of one request, and concurrent requests with one system prompt, share their prompt's KV."""
        if not self.pool.enable_prefix_caching or req.num_computed_tokens or req.block_ids:
            return False
        if req.params.prompt_logprobs is not None:  # computes its whole prompt anyway
            return False
        mine = self._prompt_hashes(req)
        if not mine:
            return False
        for other in self.running:
            if other.num_computed_tokens >= other.num_prompt_tokens:
                continue
            theirs = self._prompt_hashes(other)
            shared = 0
            while shared < min(len(mine), len(theirs)) and mine[shared] == theirs[shared]:
                shared += 1
            if shared and other.num_computed_tokens < shared * self.block_size:
                return True
        return False

    def _prompt_hashes(self, req: Request) -> list[bytes]:
        """The chained hashes of the prompt's full blocks, from the request's own hash cache (``block_hashes``,
        which ``_prefix_hits`` and ``_cache_full_blocks`` fill from the same chain), filled here when short."""
        num = req.num_prompt_tokens // self.block_size
        if len(req.block_hashes) < num:
            req.block_hashes = hash_full_blocks(req.prompt_token_ids, self.block_size)
        return req.block_hashes[:num]

    def _prefix_hits(self, req: Request) -> list[int]:
        """Cached blocks for the request's leading full blocks; at least one token is always left to compute."""
        if not self.pool.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        # Hashes depend on tokens only: a request waiting for blocks keeps the ones it computed.
        if len(req.block_hashes) < max_blocks:
            req.block_hashes = hash_full_blocks(req.tokens(0, max_blocks * self.block_size), self.block_size)
        hashes = req.block_hashes[:max_blocks]
        hits = self.pool.lookup_prefix(hashes)
        self.pool.record_prefix_query(len(hashes), len(hits))
        return hits

    def _cache_full_blocks(self, req: Request) -> None:
        if not self.pool.enable_prefix_caching:
            return
        full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if full <= req.num_hashed_blocks:
            return
        parent = req.block_hashes[-1] if req.block_hashes else None
        new_hashes = []
        for i in range(len(req.block_hashes), full):
            parent = hash_block(parent, req.tokens(i * self.block_size, (i + 1) * self.block_size))
            new_hashes.append(parent)
        req.block_hashes.extend(new_hashes)
        self.pool.cache_blocks(
            req.block_ids[req.num_hashed_blocks : full], req.block_hashes[req.num_hashed_blocks : full]
        )
        req.num_hashed_blocks = full
