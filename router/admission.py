"""Admission control at the edge: what each route class holds now and how fast it drains.

One ``AdmissionController`` per router replica (budgets in ``AdmissionConfig`` are per
router replica). ``snapshot()`` feeds the pure classifier; ``admit``/``release`` keep the
counts; the drain rate (tokens/s over a sliding window of finished requests) is what the
Retry-After prediction divides by. Also the prefix estimator the classifier's cached-token
input comes from. Not thread-safe: used from the router's event loop only.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.serving.config import AdmissionConfig
from router.classifier import ClassLoad, LoadSnapshot, Route


@dataclass(frozen=True)
class Ticket:
    route: Route
    cost_tokens: int
    admitted_at: float


class _ClassState:
    def __init__(self, initial_tokens_per_s: float, window_s: float):
        self.requests = 0
        self.tokens = 0
        self.initial_tokens_per_s = initial_tokens_per_s
        self.window_s = window_s
        self.done: deque[tuple[float, int]] = deque()  # (finish time, tokens)

    def tokens_per_s(self, now: float) -> float:
        while self.done and self.done[0][0] < now - self.window_s:
            self.done.popleft()
        if len(self.done) < 2:
            return self.initial_tokens_per_s
        span = max(now - self.done[0][0], 1e-3)
        return max(sum(t for _, t in self.done) / span, 1e-3)


class AdmissionController:
    def __init__(self, config: AdmissionConfig, window_s: float = 30.0, clock=time.monotonic):
        self.config = config
        self.clock = clock
        self._classes = {
            Route.LOCAL: _ClassState(config.initial_tokens_per_s, window_s),
            Route.REMOTE: _ClassState(config.initial_tokens_per_s, window_s),
        }

    def snapshot(self, prefill_available: bool = True) -> LoadSnapshot:
        now = self.clock()

        def load(r: Route) -> ClassLoad:
            s = self._classes[r]
            return ClassLoad(s.requests, s.tokens, s.tokens_per_s(now))

        return LoadSnapshot(load(Route.LOCAL), load(Route.REMOTE), prefill_available)

    def admit(self, route: Route, cost_tokens: int) -> Ticket:
        s = self._classes[route]
        s.requests += 1
        s.tokens += cost_tokens
        return Ticket(route, cost_tokens, self.clock())

    def release(self, ticket: Ticket, tokens_done: int | None = None) -> None:
        """Returns the ticket's budget. ``tokens_done``: tokens actually processed (for the drain rate)."""
        s = self._classes[ticket.route]
        s.requests -= 1
        s.tokens -= ticket.cost_tokens
        s.done.append((self.clock(), ticket.cost_tokens if tokens_done is None else tokens_done))

    def inflight(self, route: Route) -> tuple[int, int]:
        s = self._classes[route]
        return s.requests, s.tokens


class PrefixEstimator:
    """Which full-block prefixes recently went to the decode pool (an LRU of chained block hashes).

    An estimate: with several decode replicas a prefix may be cached on another one, and a
    replica may have evicted it. It only decides whether a prefill is cheap enough to run locally.
    """

    def __init__(self, capacity_blocks: int = 65536):
        self.capacity = capacity_blocks
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def cached_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Length of the longest known prefix. Does not modify the estimator."""
        n = 0
        for h in block_hashes:
            if h not in self._seen:
                break
            n += 1
        return n

    def record(self, block_hashes: Sequence[bytes]) -> None:
        for h in block_hashes:
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
