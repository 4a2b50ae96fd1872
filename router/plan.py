"""From a validated request and its tokens to a plan: sampling parameters, geometry, route. Pure.

No clocks, no I/O, no state: the same inputs give the same ``RequestPlan`` (or the same error),
so the whole decision at the edge is unit-tested without a server. ``router.server`` carries the
plan out (admission ticket, dispatch, response).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cluster.config import SamplingParams, check_stop_token_ids
from cluster.errors import ShapeserveError
from cluster.openai_protocol import APIError
from cluster.prefix_hash import hash_full_blocks
from cluster.prompting import check_prompt
from cluster.serving.config import ServeConfig
from cluster.serving.messages import Route
from router.classifier import LoadSnapshot, RequestGeometry, RouteDecision, classify


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class RequestPlan:
    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    geometry: RequestGeometry
    decision: RouteDecision

    @property
    def route(self) -> Route:
        return self.decision.route


def user_error(e: ShapeserveError) -> APIError:
    return APIError(e.http_status, e.message, e.error_type, e.param, e.code)


def _as_sent(e: ShapeserveError, budget_field: str) -> ShapeserveError:
    """``e`` naming the output budget as the client sent it: the engine calls it ``max_tokens``, a chat client
    may have sent ``max_completion_tokens``."""
    if e.param != "max_tokens" or budget_field == "max_tokens":
        return e
    return type(e)(e.message.replace("max_tokens", budget_field), budget_field, e.code)


def default_max_tokens(kind: str, num_prompt_tokens: int, limits: ModelLimits) -> int:
    """OpenAI's defaults: 16 for completions, the rest of the context for chat."""
    return 16 if kind == "completion" else max(1, limits.max_model_len - num_prompt_tokens)


def plan_request(
    kind: str,
    request,
    prompt: list[int],
    limits: ModelLimits,
    config: ServeConfig,
    load: LoadSnapshot,
    cached_blocks: Callable[[Sequence[bytes]], int],
    priority: int = 0,
) -> RequestPlan:
    """The plan, with route REJECT when the request's class is full (``rejection(plan)`` is the 429 to answer).
    Raises APIError (400) for a request that can never run.

    ``request``: the validated body (``cluster.openai_protocol``); ``cached_blocks(hashes)``: how many leading
    blocks are believed to be in the decode replica's prefix cache (read-only); ``load``: the admission state."""
    try:
        # First: the params' own range check would name no index.
        check_stop_token_ids(request.stop_token_ids or (), limits.vocab_size)
        params = request.sampling_params(default_max_tokens(kind, len(prompt), limits))
        params.check_vocab(limits.vocab_size)
        check_prompt(prompt, params.max_tokens, limits.vocab_size, limits.max_model_len)
    except ShapeserveError as e:
        raise user_error(_as_sent(e, request.max_tokens_field())) from None
    bs = config.block_tokens
    hashes = tuple(hash_full_blocks(prompt, bs))
    # A request scoring its prompt computes all of it (the engine does not read it from the prefix cache).
    cached = 0 if params.prompt_logprobs is not None else cached_blocks(hashes) * bs
    geometry = RequestGeometry(
        len(prompt),
        cached,
        params.max_tokens,
        config.dtype,
        priority,
        scores_prompt=params.prompt_logprobs is not None,
    )
    decision = classify(geometry, config.classifier, config.admission, load)
    return RequestPlan(params, tuple(prompt), hashes, geometry, decision)


def rejection(
    plan: RequestPlan,
    config: ServeConfig,
    rng: random.Random | None = None,
    appointment: Callable[[float], float] | None = None,
) -> APIError:
    """The 429 for a REJECT plan, with Retry-After from the class's predicted wait, spread over
    [wait, wait x (1 + retry_after_jitter)]: clients refused in the same burst do not all come back in the same
    second (and find the class full again). ``rng``: where the spread is drawn from (a seeded one in tests);
    ``appointment``: books the client's return no earlier than the spread wait and gives the seconds until it
    (``AdmissionController.appointment``)."""
    d = plan.decision
    adm = config.admission
    wait = d.retry_after_s or adm.min_retry_after_s
    spread = wait * (1.0 + (rng or random).uniform(0.0, adm.retry_after_jitter))
    if appointment is not None:
        spread = appointment(spread)
    retry = min(max(math.ceil(spread), adm.min_retry_after_s), adm.max_retry_after_s)
    return APIError(
        429,
        f"server is at capacity for {d.route_class.value} requests ({d.reason}); retry after {retry} s",
        "rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(retry)},
    )
