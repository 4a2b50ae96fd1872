"""The geometry classifier: from what is known about a request at arrival to its route.

A pure function (no I/O, no clocks, no globals): the same inputs give the same decision,
so it is unit-tested exactly. Its inputs are the request's geometry and a snapshot of the
admission state; its thresholds come from ``ClassifierConfig`` / ``AdmissionConfig``.

  LOCAL  - few uncached prompt tokens: the decode replica prefills them itself, no transfer
           (also when no prefill replica can take it or the KV format cannot be handed over)
  REMOTE - the prefill pool prefills and pushes the KV blocks to the decode replica
  REJECT - the class's admission budget is full, the prompt tokens waiting ahead of the request
           would make it miss the time-to-first-token target, or the streams already run slower
           than the time-per-output-token target: 429 with Retry-After = the predicted wait
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cluster.serving.config import AdmissionConfig, ClassBudget, ClassifierConfig
from cluster.serving.messages import Route


@dataclass(frozen=True)
class RequestGeometry:
    prompt_tokens: int
    #: Estimate of prompt tokens already in the decode pool's prefix cache.
    cached_tokens: int
    max_tokens: int
    kv_format: str
    priority: int = 0
    #: The request asks for its prompt's logprobs, which are computed where the prompt is prefilled.
    scores_prompt: bool = False

    @property
    def uncached_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    @property
    def cost_tokens(self) -> int:
        """What the request holds against its class's token budget while admitted."""
        return self.prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class ClassLoad:
    """One route class's admitted work at this moment, and how fast that class drains it."""

    inflight_requests: int = 0
    inflight_tokens: int = 0
    tokens_per_s: float = 1.0
    #: Uncached prompt tokens of admitted requests still waiting for their first token.
    waiting_prefill_tokens: int = 0
    #: Measured prompt tokens per second reaching their first token while some waited (None: not yet known).
    prefill_tokens_per_s: float | None = None


@dataclass(frozen=True)
class LoadSnapshot:
    local: ClassLoad = ClassLoad()
    remote: ClassLoad = ClassLoad()
    #: False when no prefill replica is healthy: everything prefills locally.
    prefill_available: bool = True
    #: The time-to-first-token target admission keeps (None: budgets only).
    ttft_target_s: float | None = None
    #: The time-per-output-token target, and the edge's recent pace (None: not kept / nothing streaming).
    tpot_target_s: float | None = None
    seconds_per_token: float | None = None

    def stricter(self, scale: float) -> LoadSnapshot:
        """The same load judged against ``scale`` x the SLO targets."""
        ttft = self.ttft_target_s * scale if self.ttft_target_s is not None else None
        tpot = self.tpot_target_s * scale if self.tpot_target_s is not None else None
        return dataclasses.replace(self, ttft_target_s=ttft, tpot_target_s=tpot)

    @property
    def busy(self) -> bool:
        return self.local.inflight_requests + self.remote.inflight_requests > 0

    def of(self, route: Route) -> ClassLoad:
        return self.local if route is Route.LOCAL else self.remote


@dataclass(frozen=True)
class RouteDecision:
    route: Route
    #: The class whose budget applies (for REJECT: the class that was full).
    route_class: Route
    reason: str
    retry_after_s: int | None = None


def route_class(g: RequestGeometry, cfg: ClassifierConfig, prefill_available: bool = True) -> tuple[Route, str]:
    """LOCAL or REMOTE by geometry alone (no admission)."""
    if g.scores_prompt:
        return Route.LOCAL, "prompt logprobs are computed on the decode replica, which prefills the prompt itself"
    if g.uncached_tokens <= cfg.local_max_uncached_tokens:
        return Route.LOCAL, f"{g.uncached_tokens} uncached prompt tokens <= {cfg.local_max_uncached_tokens}"
    if g.kv_format not in cfg.remote_kv_formats:
        return Route.LOCAL, f"KV format {g.kv_format} cannot be handed over by the prefill pool"
    if not prefill_available:
        return Route.LOCAL, "no prefill replica available"
    return Route.REMOTE, f"{g.uncached_tokens} uncached prompt tokens > {cfg.local_max_uncached_tokens}"


def predicted_wait_s(g: RequestGeometry, load: ClassLoad, budget: ClassBudget, scale: float) -> float:
    """Seconds until the class has drained enough admitted work for this request to fit."""
    rate = max(load.tokens_per_s, 1e-6)
    excess_tokens = load.inflight_tokens + g.cost_tokens - budget.max_inflight_tokens * scale
    wait = max(excess_tokens, 0.0) / rate
    if load.inflight_requests + 1 > budget.max_inflight_requests * scale and load.inflight_requests:
        # One average admitted request has to finish.
        wait = max(wait, load.inflight_tokens / load.inflight_requests / rate)
    return wait


def classify(
    g: RequestGeometry, cfg: ClassifierConfig, admission: AdmissionConfig, load: LoadSnapshot
) -> RouteDecision:
    """The route of one request. Pure: does not modify ``load``."""
    klass, reason = route_class(g, cfg, load.prefill_available)
    budget = admission.local if klass is Route.LOCAL else admission.remote
    cl = load.of(klass)
    scale = 1.0 + cfg.priority_headroom if g.priority >= cfg.high_priority else 1.0
    # An idle class admits anything (a request larger than the token budget would otherwise never run).
    if cl.inflight_requests > 0:
        too_many = cl.inflight_requests + 1 > budget.max_inflight_requests * scale
        too_big = cl.inflight_tokens + g.cost_tokens > budget.max_inflight_tokens * scale
        if too_many or too_big:
            wait = predicted_wait_s(g, cl, budget, scale)
            retry = min(max(math.ceil(wait), admission.min_retry_after_s), admission.max_retry_after_s)
            what = "requests" if too_many else "tokens"
            return RouteDecision(Route.REJECT, klass, f"{klass.value} class budget of in-flight {what} is full", retry)
    pace, tpot_target = load.seconds_per_token, load.tpot_target_s
    if tpot_target is not None and pace is not None and load.busy and pace > tpot_target * scale:
        # Another sequence would slow every stream further: wait for an admitted request to finish.
        drain = cl if cl.inflight_requests else load.of(Route.REMOTE if klass is Route.LOCAL else Route.LOCAL)
        wait = drain.inflight_tokens / max(drain.inflight_requests, 1) / max(drain.tokens_per_s, 1e-6)
        retry = min(max(math.ceil(wait), admission.min_retry_after_s), admission.max_retry_after_s)
        why = f"streams run at {1000 * pace:.0f} ms per token, past the {1000 * tpot_target * scale:.0f} ms target"
        return RouteDecision(Route.REJECT, klass, why, retry)
    rate = cl.prefill_tokens_per_s
    # With prompts waiting and the class's prefill rate measured: would this one miss the TTFT target?
    if load.ttft_target_s is not None and cl.waiting_prefill_tokens > 0 and rate:
        ahead = cl.waiting_prefill_tokens + g.uncached_tokens
        predicted, target = ahead / rate, load.ttft_target_s * scale
        if predicted > target:
            # Until enough of what waits now has drained for a request like this one to meet the target.
            wait = predicted - target
            retry = min(max(math.ceil(wait), admission.min_retry_after_s), admission.max_retry_after_s)
            why = f"predicted time to first token {predicted:.1f} s is past the {target:.1f} s target"
            return RouteDecision(Route.REJECT, klass, why, retry)
    return RouteDecision(klass, klass, reason)
