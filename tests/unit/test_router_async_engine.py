"""The threaded engine driver the pool replicas run (no Ray): streams, aborts, engine-thread calls."""

import asyncio

from cluster.serving.async_engine import AsyncEngine, next_output
from cluster.config import CacheConfig, EngineConfig, SamplingParams
from cluster.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def make_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), cache=CacheConfig(num_blocks=64)))


def test_streams_match_offline_generate_and_abort_frees_blocks(demo_model):
    prompts = [[5, 6, 7, 8], list(range(10, 50))]
    want = [r["token_ids"] for r in make_engine(demo_model).generate(prompts, GREEDY)]

    async def main():
        ae = AsyncEngine(make_engine(demo_model))
        ae.start(asyncio.get_running_loop())
        try:
            qs = [await ae.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
            long_q = await ae.add_request("long", list(range(60, 90)), SamplingParams(max_tokens=500, ignore_eos=True))
            got = []
            for q in qs:
                ids = []
                while True:
                    out = await next_output(q)
                    ids += out.new_token_ids
                    if out.finished:
                        break
                got.append(ids)
            await next_output(long_q)  # running
            ae.abort("long")
            ae.abort("long")  # idempotent
            used = await ae.call(lambda e: e.block_pool.num_used_blocks)
            assert await ae.check_integrity()
            return got, used, ae.snapshot()
        finally:
            ae.shutdown()

    got, used, snap = asyncio.run(main())
    assert got == want
    assert used == 0 and snap["active_requests"] == 0 and snap["kv_blocks_used"] == 0


def test_call_propagates_errors(demo_model):
    async def main():
        ae = AsyncEngine(make_engine(demo_model))
        ae.start(asyncio.get_running_loop())
        try:
            await ae.call(lambda e: e.add_request("x", [], GREEDY))
        except Exception as exc:  # InvalidRequestError: empty prompt  # noqa: BLE001
            return exc
        finally:
            ae.shutdown()

    assert "empty" in str(asyncio.run(main()))
