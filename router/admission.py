"""Admission control at the edge: what each route class holds now and how fast it drains.

One ``AdmissionController`` per router replica (budgets in ``AdmissionConfig`` are per
router replica). ``snapshot()`` feeds the pure classifier; ``admit`` / ``first_token`` /
``release`` keep the counts. Two rates are measured per class:

- the drain rate (tokens/s over a sliding window of finished requests), what the budget's
  Retry-After divides by;
- the prefill rate (``PrefillMeter``): uncached prompt tokens that reached their first token
  per second, counted only while some admitted request of the class was waiting for its first
  token. A new request's time to first token is predicted from it and the prompt tokens
  waiting ahead of it; the classifier refuses what would miss the TTFT target.

And one pace for the whole edge (``TokenPace``): the recent time per output token of its
streams. While it is past the TPOT target, another sequence would only slow every stream
further, so the classifier refuses new requests until running ones finish.

A 429's Retry-After is an appointment (``RetryAppointments``): spaced by the rate the edge
finishes requests, so refused clients come back as room frees rather than together, and
held for them: until it is kept or lapses, a new request is judged against a stricter target
(``router.server.HELD_ROOM_TARGET_SCALE``), so the room goes to the client coming back.

Also the prefix estimator the classifier's cached-token input comes from. Not thread-safe:
used from the router's event loop only.
"""

from __future__ import annotations

import math
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
    #: Uncached prompt tokens: what this request's prefill adds to its class's queue.
    prefill_tokens: int = 0


#: Finished prefills a class needs in its window before its measured rate is trusted (before: budgets only).
MIN_PREFILL_SAMPLES = 4


class PrefillMeter:
    """How fast a class's admitted prompts reach their first token. The rate is measured over busy time only
    (some admitted request waiting for its first token), so an idle server's pauses do not read as slowness;
    with several waiting, their prefills overlap and the rate shows the batching the pool achieves."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        #: Admitted requests still waiting for their first token, and their uncached prompt tokens.
        self.waiting = 0
        self.waiting_tokens = 0
        self._busy_since: float | None = None
        self._busy: deque[tuple[float, float]] = deque()  # ended busy intervals
        self._done: deque[tuple[float, int]] = deque()  # (first token time, prompt tokens)

    def started(self, tokens: int, now: float) -> None:
        if self.waiting == 0:
            self._busy_since = now
        self.waiting += 1
        self.waiting_tokens += tokens

    def ended(self, tokens: int, now: float, reached_first_token: bool) -> None:
        """A waiting request got its first token (``reached_first_token``), or ended without one."""
        self.waiting -= 1
        self.waiting_tokens -= tokens
        if reached_first_token:
            self._done.append((now, tokens))
        if self.waiting == 0 and self._busy_since is not None:
            self._busy.append((self._busy_since, now))
            self._busy_since = None

    def tokens_per_s(self, now: float) -> float | None:
        """Prompt tokens per busy second over the window; None until ``MIN_PREFILL_SAMPLES`` prefills finished
        in it."""
        start = now - self.window_s
        while self._done and self._done[0][0] < start:
            self._done.popleft()
        while self._busy and self._busy[0][1] < start:
            self._busy.popleft()
        if len(self._done) < MIN_PREFILL_SAMPLES:
            return None
        busy = sum(end - max(begin, start) for begin, end in self._busy)
        if self._busy_since is not None:
            busy += now - max(self._busy_since, start)
        return max(sum(t for _, t in self._done), 1) / max(busy, 1e-3)


class TokenPace:
    """Recent seconds per output token across this edge's streams, as TPOT counts them: the streams' gaps summed
    over the tokens they brought (each sum decayed with a time constant of ``tau_s``), forgotten ``stale_s`` after
    the last observation (nothing streaming: no pace).

    Weighted by tokens, not by time: one long prefill step that stalls every stream for half a second (a long
    prompt joining the batch) adds half a second to each stream's next token, as it does to their TPOT, instead of
    standing for the pace for half a second. An average of per-event gaps weighted by time read 205-290 ms
    per token after such steps while the requests' mean TPOT was 36-48 ms, and refused 8-14 of skewed-64's 64
    requests at 2 req/s (``bench/compare_vllm.sh``, 2026-11-24). The time constant is about a stream's life
    (128 tokens at 40 ms)."""

    def __init__(self, tau_s: float = 5.0, stale_s: float = 10.0):
        self.tau_s = tau_s
        self.stale_s = stale_s
        self._gap_s = 0.0
        self._tokens = 0.0
        self._at: float | None = None

    def observe(self, gap_s: float, tokens: int, now: float) -> None:
        """A stream got ``tokens`` more tokens ``gap_s`` after its previous ones."""
        if self._at is None or now - self._at > self.stale_s:
            self._gap_s = self._tokens = 0.0
        else:
            keep = math.exp(-max(now - self._at, 0.0) / self.tau_s)
            self._gap_s *= keep
            self._tokens *= keep
        self._gap_s += gap_s
        self._tokens += tokens
        self._at = now

    def seconds_per_token(self, now: float) -> float | None:
        if self._at is None or now - self._at > self.stale_s or self._tokens <= 0:
            return None
        return self._gap_s / self._tokens


class RetryAppointments:
    """When the clients refused with a 429 are told to come back. Each appointment is no earlier than the
    refusal's predicted wait and at least ``spacing`` after the one before (the edge's finish rate), so the
    clients return about as fast as requests finish. While one is due and not yet kept (a retry arrived) or
    lapsed (``grace_s`` later), the room is held for it: the edge admits a new request only against a
    stricter target, and books the refused behind."""

    def __init__(self, grace_s: float = 1.5, horizon_s: float = 60.0):
        """``grace_s``: how long past its time an appointment is held (Retry-After is whole seconds, so a client
        comes back up to a second late); ``horizon_s``: no appointment further out than this (a queue of
        promises longer than that would only hold room for clients that gave up)."""
        self.grace_s = grace_s
        self.horizon_s = horizon_s
        self._times: deque[float] = deque()

    def _lapse(self, now: float) -> None:
        while self._times and self._times[0] < now - self.grace_s:
            self._times.popleft()

    def book(self, earliest: float, spacing_s: float, now: float) -> float:
        """An appointment no earlier than ``earliest``; returns its time. Past the horizon none is held: the
        time returned is then only advice."""
        at = max(earliest, self._times[-1] + spacing_s) if self._times else earliest
        if at - now <= self.horizon_s:
            self._times.append(at)
        return at

    def due(self, now: float) -> bool:
        """Some appointment's time has come and it was neither kept nor lapsed."""
        self._lapse(now)
        return bool(self._times) and self._times[0] <= now

    def keep(self, now: float) -> None:
        """A client came back: the earliest appointment due (or due within ``grace_s``) is kept."""
        self._lapse(now)
        if self._times and self._times[0] <= now + self.grace_s:
            self._times.popleft()


class _ClassState:
    def __init__(self, initial_tokens_per_s: float, window_s: float):
        self.requests = 0
        self.tokens = 0
        self.initial_tokens_per_s = initial_tokens_per_s
        self.window_s = window_s
        self.done: deque[tuple[float, int]] = deque()  # (finish time, tokens)
        self.prefill = PrefillMeter(window_s)

    def tokens_per_s(self, now: float) -> float:
        while self.done and self.done[0][0] < now - self.window_s:
            self.done.popleft()
        if len(self.done) < 2:
            return self.initial_tokens_per_s
        span = max(now - self.done[0][0], 1e-3)
        return max(sum(t for _, t in self.done) / span, 1e-3)


class AdmissionController:
    def __init__(
        self,
        config: AdmissionConfig,
        window_s: float = 30.0,
        clock=time.monotonic,
        ttft_target_s: float | None = None,
        tpot_target_s: float | None = None,
    ):
        """``ttft_target_s`` / ``tpot_target_s``: the SLO admission keeps (None: budgets only)."""
        self.config = config
        self.clock = clock
        self.ttft_target_s = ttft_target_s
        self.tpot_target_s = tpot_target_s
        self.pace = TokenPace()
        self.window_s = window_s
        # Appointments as far out as a Retry-After may send a client.
        self.appointments = RetryAppointments(horizon_s=config.max_retry_after_s)
        self._classes = {
            Route.LOCAL: _ClassState(config.initial_tokens_per_s, window_s),
            Route.REMOTE: _ClassState(config.initial_tokens_per_s, window_s),
        }

    def snapshot(self, prefill_available: bool = True) -> LoadSnapshot:
        now = self.clock()

        def load(r: Route) -> ClassLoad:
            s = self._classes[r]
            return ClassLoad(
                s.requests, s.tokens, s.tokens_per_s(now), s.prefill.waiting_tokens, s.prefill.tokens_per_s(now)
            )

        return LoadSnapshot(
            load(Route.LOCAL),
            load(Route.REMOTE),
            prefill_available,
            self.ttft_target_s,
            self.tpot_target_s,
            self.pace.seconds_per_token(now),
        )

    def tokens_streamed(self, gap_s: float, tokens: int = 1) -> None:
        """A stream got ``tokens`` more tokens ``gap_s`` after its previous ones."""
        self.pace.observe(gap_s, tokens, self.clock())

    def admit(self, route: Route, cost_tokens: int, prefill_tokens: int = 0) -> Ticket:
        s = self._classes[route]
        s.requests += 1
        s.tokens += cost_tokens
        now = self.clock()
        s.prefill.started(prefill_tokens, now)
        return Ticket(route, cost_tokens, now, prefill_tokens)

    def first_token(self, ticket: Ticket) -> None:
        """The ticket's request produced its first token: its prefill leaves the class's queue."""
        self._classes[ticket.route].prefill.ended(ticket.prefill_tokens, self.clock(), reached_first_token=True)

    def release(self, ticket: Ticket, tokens_done: int | None = None, reached_first_token: bool = True) -> None:
        """Returns the ticket's budget. ``tokens_done``: tokens actually processed (for the drain rate);
        ``reached_first_token``: False for a request that ended before its first token (``first_token`` was
        not called), which leaves the prefill queue here."""
        s = self._classes[ticket.route]
        s.requests -= 1
        s.tokens -= ticket.cost_tokens
        now = self.clock()
        if not reached_first_token:
            s.prefill.ended(ticket.prefill_tokens, now, reached_first_token=False)
        s.done.append((now, ticket.cost_tokens if tokens_done is None else tokens_done))

    def requests_per_s(self) -> float:
        """Requests this edge finished per second over the window (both classes)."""
        start = self.clock() - self.window_s
        return sum(1 for s in self._classes.values() for t, _ in s.done if t >= start) / self.window_s

    def appointment(self, wait_s: float) -> float:
        """Books a refused client's return no earlier than ``wait_s`` from now, spaced by the finish rate;
        returns the seconds until it."""
        now = self.clock()
        rate = self.requests_per_s()
        return self.appointments.book(now + wait_s, 1.0 / rate if rate > 0 else 0.0, now) - now

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
