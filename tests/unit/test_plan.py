"""The edge's request plan: parameters, geometry and route from a validated body, as a pure function."""

import math
import random

import pytest

from cluster.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from cluster.prefix_hash import hash_full_blocks
from cluster.serving.config import parse_serve_config
from cluster.serving.messages import Route
from router.classifier import ClassLoad, LoadSnapshot
from router.plan import ModelLimits, plan_request, rejection

LIMITS = ModelLimits(vocab_size=512, max_model_len=1024)
CONFIG = parse_serve_config(
    {
        "block_size": 16,  # the prefix hashes and cached-token counts below are in 16-token blocks
        "classifier": {"local_max_uncached_tokens": 32},
        "admission": {"remote": {"max_inflight_requests": 2}},
    }
)


IDLE = LoadSnapshot()


def plan(prompt, load=IDLE, cached=lambda hashes: 0, **body):
    """``prompt``: the tokens the body's text became (the body carries a placeholder text)."""
    req = CompletionRequest.model_validate({"model": "m", "prompt": "text", **body})
    return plan_request("completion", req, prompt, LIMITS, CONFIG, load, cached)


def test_short_prompt_is_local_and_long_one_remote():
    short, long = plan([5] * 20), plan([5] * 100, max_tokens=7)
    assert (short.route, long.route) == (Route.LOCAL, Route.REMOTE)
    assert short.params.max_tokens == 16 and long.params.max_tokens == 7  # OpenAI's default for completions
    assert long.block_hashes == tuple(hash_full_blocks([5] * 100, 16)) and len(long.block_hashes) == 6
    assert long.geometry.cost_tokens == 107


def test_cached_prefix_makes_a_long_prompt_local():
    p = plan([5] * 100, cached=lambda hashes: len(hashes))  # 96 of 100 tokens cached: 4 to compute
    assert p.route is Route.LOCAL and p.geometry.cached_tokens == 96


def test_chat_default_max_tokens_is_the_rest_of_the_context():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    p = plan_request("chat", req, [5] * 24, LIMITS, CONFIG, LoadSnapshot(), lambda h: 0)
    assert p.params.max_tokens == 1000


def test_full_class_is_a_reject_with_retry_after():
    busy = LoadSnapshot(remote=ClassLoad(inflight_requests=2, inflight_tokens=300, tokens_per_s=100.0))
    p = plan([5] * 100, load=busy)
    assert p.route is Route.REJECT
    e = rejection(p, CONFIG.with_overrides(admission={**CONFIG.admission.model_dump(), "retry_after_jitter": 0}))
    assert e.status == 429 and e.headers["Retry-After"] == "2" and e.err_type == "rate_limit_error"


def test_retry_after_is_spread_so_refused_clients_do_not_return_together():
    busy = LoadSnapshot(remote=ClassLoad(inflight_requests=2, inflight_tokens=1300, tokens_per_s=100.0))
    p = plan([5] * 100, load=busy)
    wait = p.decision.retry_after_s
    assert wait == 7  # one of the 2 admitted requests (650 tokens on average) has to finish, at 100 tokens/s
    rng = random.Random(7)
    retries = [int(rejection(p, CONFIG, rng).headers["Retry-After"]) for _ in range(200)]
    # The default jitter: up to half the wait more, in whole seconds (Retry-After's unit).
    assert min(retries) >= wait and max(retries) <= math.ceil(wait * 1.5)
    assert len(set(retries)) >= 4  # spread over the window, not one second
    capped = CONFIG.with_overrides(admission={**CONFIG.admission.model_dump(), "max_retry_after_s": 8})
    assert {int(rejection(p, capped, rng).headers["Retry-After"]) for _ in range(50)} == {8}  # the cap holds


@pytest.mark.parametrize(
    "prompt, body, param",
    [
        ([], {}, "prompt"),
        ([600], {}, "prompt"),
        ([5] * 1000, {"max_tokens": 100}, "max_tokens"),
        ([5], {"top_k": 2**40}, "top_k"),
    ],
)
def test_requests_that_can_never_run_are_400s(prompt, body, param):
    with pytest.raises(APIError) as e:
        plan(prompt, **body)
    assert e.value.status == 400 and e.value.param == param
