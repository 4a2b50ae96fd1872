"""One request's failure in the engine ends that request only: the step is re-run request by request,
the culprit gets an error output and its blocks back, every other request continues unchanged."""

import asyncio

import pytest

from cluster.config import SamplingParams
from cluster.engine import model_runner
from cluster.engine.llm_engine import LLMEngine
from cluster.errors import InvalidRequestError
from cluster.serving.async_engine import AsyncEngine, EngineDead
from tests.helpers import engine_config, random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
POISON_SEED = 666


@pytest.fixture
def engine(demo_model):
    return LLMEngine(engine_config(demo_model, num_blocks=64))


def _sampler_that_fails_on_poison(monkeypatch):
    real = model_runner.sample

    def sample(logits, params, *rest):
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("sampling blew up")
        return real(logits, params, *rest)

    monkeypatch.setattr(model_runner, "sample", sample)


def test_a_failing_request_ends_alone_and_the_others_are_unchanged(engine, demo_model, monkeypatch):
    prompts = random_prompts(3, [5, 20, 40], 512, seed=9)
    want = LLMEngine(engine_config(demo_model, num_blocks=64)).generate(prompts, GREEDY)
    _sampler_that_fails_on_poison(monkeypatch)
    for i, p in enumerate(prompts):
        engine.add_request(f"ok{i}", p, GREEDY)
    poison = SamplingParams(max_tokens=8, temperature=0.7, seed=POISON_SEED)
    engine.add_request("poison", [7, 8, 9], poison)
    got: dict[str, list[int]] = {}
    errors = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.error is not None:
                errors[out.request_id] = (out.finish_reason, out.error)
    assert errors == {"poison": ("error", "RuntimeError: sampling blew up")}
    assert got["poison"] == []
    assert [got[f"ok{i}"] for i in range(3)] == [r["token_ids"] for r in want]
    engine.block_pool.check_integrity()
    assert engine.block_pool.num_used_blocks == 0 and not engine.requests


def test_unrepresentable_parameters_are_refused_before_the_batch(engine):
    for params, field in [
        (SamplingParams(temperature=0.7, top_k=2**64), "top_k"),
        (SamplingParams(seed=2**64), "seed"),
        (SamplingParams(max_tokens=2**40), "max_tokens"),
        (SamplingParams(stop_token_ids=(2**70,)), "stop_token_ids"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("bad", [5, 6], params)
        assert e.value.param == field
    assert not engine.requests


def test_top_k_above_the_vocabulary_samples_from_all_of_it(engine):
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.7, top_k=2**31 - 1, seed=1))
    engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.7, top_k=0, seed=1))
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert outs["a"] == outs["b"] and len(outs["a"]) == 4


def test_async_engine_survives_a_step_failure_it_cannot_pin_on_one_request(engine):
    """A failure outside the model run (here: the scheduler) ends the requests in the engine with an error
    event, and the loop goes on serving new ones."""

    async def main():
        ae = await AsyncEngine.launch(lambda: engine)
        try:
            schedule = engine.scheduler.schedule
            calls = {"n": 0}

            def flaky_schedule():
                calls["n"] += 1
                if calls["n"] == 2:
                    raise RuntimeError("scheduler bug")
                return schedule()

            engine.scheduler.schedule = flaky_schedule
            q = await ae.add_request(
                "victim", [5, 6, 7], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
            )
            with pytest.raises(EngineDead, match="scheduler bug"):
                while True:
                    await q.get()
            assert ae.alive
            q2 = await ae.add_request("after", [5, 6, 7], GREEDY)
            n = 0
            while not (out := await q2.get()).finished:
                n += 1
            assert n + 1 == 8 and out.error is None
            assert await ae.check_integrity()
            return await ae.call(lambda e: e.block_pool.num_used_blocks)
        finally:
            ae.shutdown()

    assert asyncio.run(main()) == 0
