"""The geometry classifier: from what is known about a request at arrival to its route.

A pure function (no I/O, no clocks, no globals): the same inputs give the same decision,
so it is unit-tested exactly. Its inputs are the request's geometry and a snapshot of the
admission state; its thresholds come from ``ClassifierConfig`` / ``AdmissionConfig``.

  LOCAL  - few uncached prompt tokens: the decode replica prefills them itself, no transfer
           (also when no prefill replica can take it or the KV format cannot be handed over)
  REMOTE - the prefill pool prefills and pushes the KV blocks to the decode replica
  REJECT - the class's admission budget is full: 429 with Retry-After = the class's predicted wait
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class LoadSnapshot:
    local: ClassLoad = ClassLoad()
    remote: ClassLoad = ClassLoad()
    #: False when no prefill replica is healthy: everything prefills locally.
    prefill_available: bool = True

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
    return RouteDecision(klass, klass, reason)
