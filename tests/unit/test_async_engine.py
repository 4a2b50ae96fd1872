"""The threaded engine driver the pool replicas run (no Ray): streams, aborts, engine-thread calls,
and one hand-over to the event loop per engine step."""

import asyncio
import sys
import threading
from pathlib import Path

import pytest

from cluster.config import CacheConfig, EngineConfig, SamplingParams, StructuredOutput
from cluster.engine.llm_engine import LLMEngine
from cluster.serving.async_engine import AsyncEngine, OutputStream, RequestIdInUse

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def make_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), cache=CacheConfig(num_blocks=64)))


async def drain(stream) -> list[int]:
    ids = []
    while True:
        out = await stream.get()
        ids += out.new_token_ids
        if out.finished:
            return ids


def test_streams_match_offline_generate_and_abort_frees_blocks(demo_model):
    prompts = [[5, 6, 7, 8], list(range(10, 50))]
    want = [r["token_ids"] for r in make_engine(demo_model).generate(prompts, GREEDY)]

    async def main():
        ae = await AsyncEngine.launch(lambda: make_engine(demo_model))
        try:
            streams = [await ae.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
            long = await ae.add_request("long", list(range(60, 90)), SamplingParams(max_tokens=500, ignore_eos=True))
            got = [await drain(s) for s in streams]
            await long.get()  # running
            ae.abort("long")
            ae.abort("long")  # idempotent
            used = await ae.call(lambda e: e.block_pool.num_used_blocks)
            assert await ae.check_integrity()
            return got, used, ae.stats()
        finally:
            ae.shutdown()

    got, used, stats = asyncio.run(main())
    assert got == want
    assert used == 0 and stats.active_requests == 0 and stats.kv_blocks_used == 0


def test_one_hand_over_per_step_whatever_the_batch(demo_model, monkeypatch):
    """A step's outputs for every request cross to the event loop in one call (not one per request)."""
    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(cb, *args):
            if getattr(cb, "__name__", "") == "_deliver":  # the step hand-over (ae is not bound yet at launch)
                calls.append(len(args[0]))
            return real(cb, *args)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
        ae = await AsyncEngine.launch(lambda: make_engine(demo_model))
        try:
            streams = [await ae.add_request(f"r{i}", [5 + i, 6, 7], GREEDY) for i in range(8)]
            for s in streams:
                await drain(s)
            return ae.num_steps
        finally:
            ae.shutdown()

    steps = asyncio.run(main())
    assert sum(calls) == 8 * GREEDY.max_tokens  # every output delivered
    assert len(calls) <= steps  # at most one hand-over per step
    assert max(calls) > 1  # several requests' outputs in one hand-over


def test_a_consumer_that_falls_behind_gets_the_backlog_at_once(demo_model):
    async def main():
        ae = await AsyncEngine.launch(lambda: make_engine(demo_model))
        try:
            s = await ae.add_request("r", [5, 6, 7], GREEDY)
            await asyncio.sleep(1.0)  # every step has run by now
            first = await s.get()
            return [first, *s.get_ready()]
        finally:
            ae.shutdown()

    outs = asyncio.run(main())
    assert len(outs) == GREEDY.max_tokens and outs[-1].finished


def test_call_propagates_errors_and_leaves_no_stream(demo_model):
    async def main():
        ae = await AsyncEngine.launch(lambda: make_engine(demo_model))
        try:
            with pytest.raises(Exception, match="empty"):
                await ae.add_request("x", [], GREEDY)
            return dict(ae._streams)
        finally:
            ae.shutdown()

    assert asyncio.run(main()) == {}


def test_a_second_request_under_a_running_ones_id_leaves_the_running_one_whole(demo_model):
    """An id already streaming is refused, whichever way the second request comes in: the first request keeps its
    stream and finishes with every token (before, the second one's failure closed the first one's stream)."""
    want = make_engine(demo_model).generate([[5, 6, 7, 8]], GREEDY)[0]["token_ids"]

    async def main():
        ae = await AsyncEngine.launch(lambda: make_engine(demo_model))
        try:
            first = await ae.add_request("same", [5, 6, 7, 8], GREEDY)
            with pytest.raises(RequestIdInUse, match="'same'"):
                await ae.add_request("same", [9, 10, 11], GREEDY)
            with pytest.raises(RequestIdInUse):
                ae.open_stream("same")
            with pytest.raises(ValueError, match="not the one open"):
                await ae.add_request("same", [9, 10, 11], GREEDY, stream=OutputStream("same"))
            got = await drain(first)
            # finished: the id is free again
            again = await drain(await ae.add_request("same", [5, 6, 7, 8], GREEDY))
            return got, again, ae.stats()
        finally:
            ae.shutdown()

    got, again, stats = asyncio.run(main())
    assert got == want and again == want
    assert stats.active_requests == 0 and stats.kv_blocks_used == 0


def test_a_stream_opened_before_a_failed_add_stays_with_its_opener(demo_model):
    """A caller that opened the stream itself (the decode replica) closes it with ``abort``; a failed add leaves
    it open for that, and a stream ``add_request`` opened itself is closed on failure."""

    async def main():
        ae = await AsyncEngine.launch(lambda: make_engine(demo_model))
        try:
            stream = ae.open_stream("mine")
            with pytest.raises(Exception, match="empty"):
                await ae.add_request("mine", [], GREEDY, stream=stream)
            still_open = "mine" in ae._streams
            ae.abort("mine")
            return still_open, dict(ae._streams)
        finally:
            ae.shutdown()

    assert asyncio.run(main()) == (True, {})


def test_a_slow_grammar_is_built_while_the_engine_keeps_stepping(demo_model):
    """Building a request's grammar matcher took seconds on the engine's thread for a large grammar, and no request
    got a token meanwhile; it is built on a worker thread now."""
    rule = "start: " + " | ".join(f'"{i:x}"' for i in range(20_000))  # ~1 s to check and build here

    async def main():
        ae = await AsyncEngine.launch(lambda: make_engine(demo_model))
        try:
            long = await ae.add_request("long", [5, 6, 7], SamplingParams(max_tokens=1000, ignore_eos=True))
            await long.get()  # decoding
            constrained = SamplingParams(max_tokens=1, structured=StructuredOutput("grammar", rule))
            adding = asyncio.ensure_future(ae.add_request("slow", [8, 9], constrained))
            during = 0
            while not adding.done():
                await long.get()
                during += 1
            await adding
            ae.abort("long")
            return during
        finally:
            ae.shutdown()

    assert asyncio.run(main()) >= 20  # before: one at most (the step already under way)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")
def test_engine_thread_is_named_in_the_os(demo_model):
    # Ray names every thread of a worker by the process title; the engine's CPU is found by this name.
    async def main():
        ae = await AsyncEngine.launch(lambda: make_engine(demo_model))
        try:
            await ae.call(lambda engine: None)  # the thread is running its loop
            assert ae._thread is not None and ae._thread.native_id is not None
            return Path(f"/proc/self/task/{ae._thread.native_id}/comm").read_text().strip()
        finally:
            ae.shutdown()

    assert asyncio.run(main()) == "engine-loop"


def test_launch_builds_the_engine_on_the_thread_that_steps_it(demo_model):
    """A replica's engine is built (weights, warm-up) on the thread that then runs its steps and calls: a
    second thread doing torch work would get an OpenMP team of its own (see ``AsyncEngine.launch``)."""
    threads = {}

    def build() -> LLMEngine:
        threads["build"] = threading.get_ident()
        return make_engine(demo_model)

    async def main():
        ae = await AsyncEngine.launch(build)
        try:
            stream = await ae.add_request("r", [5, 6, 7, 8], GREEDY)
            ids = await drain(stream)
            threads["call"] = await ae.call(lambda e: threading.get_ident())
            return ids
        finally:
            ae.shutdown()

    ids = asyncio.run(main())
    assert threads["build"] == threads["call"] != threading.get_ident()
    assert ids == make_engine(demo_model).generate([[5, 6, 7, 8]], GREEDY)[0]["token_ids"]


def test_launch_raises_what_the_build_raised(tmp_path):
    async def main():
        return await AsyncEngine.launch(lambda: LLMEngine(EngineConfig(model=str(tmp_path / "no-such-model"))))

    with pytest.raises(Exception, match="no-such-model"):
        asyncio.run(main())
