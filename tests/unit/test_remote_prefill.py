"""A REMOTE request between a decode and a prefill worker, in one process without Ray.

The pool workers run as they do under Serve, wired with a fake handle that can fail, hang or
succeed, and KV moving over kv_transfer (gRPC and gloo). Every scenario ends with no KV block
in use on either side and no open lease.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest

from cluster.config import CacheConfig, EngineConfig, SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.prefix_hash import hash_full_blocks
from cluster.serving.config import parse_serve_config
from cluster.serving.messages import GenerateTask, Route
from decode_workers.replica import DecodeWorker
from kv_transfer import LeaseState
from prefill_workers.replica import PrefillWorker

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [4 + (i * 37) % 500 for i in range(70)]


class FakeResponse:
    def __init__(self, coro):
        self.task = asyncio.ensure_future(coro)

    def __await__(self):
        return self.task.__await__()

    def cancel(self):
        self.task.cancel()


class FakePrefillHandle:
    """``handle.prefill.remote(task)`` like a Serve handle; ``behaviour(attempt)`` -> "ok" | "fail" | "hang"."""

    def __init__(self, worker: PrefillWorker, behaviour=lambda attempt: "ok"):
        self.worker = worker
        self.behaviour = behaviour
        self.calls = 0
        self.prefill = SimpleNamespace(remote=lambda task: FakeResponse(self._call(task)))

    async def _call(self, task):
        self.calls += 1
        what = self.behaviour(task.attempt)
        if what == "fail":
            raise RuntimeError("prefill replica died")
        if what == "hang":
            await asyncio.sleep(3600)
        return await self.worker.prefill(task)


def config(transport: str):
    pool = {"num_cpus": 0, "num_blocks": 64, "num_threads": 1}
    return parse_serve_config(
        {
            "device": "cpu",
            "block_size": 16,  # PROMPT spans 5 blocks: the transfer counts below are per block
            "transport": transport,
            "kv_transfer_host": "127.0.0.1",
            "prefill": pool,
            "decode": pool,
            "timeouts": {"prefill_timeout_s": 1.0, "max_prefill_attempts": 2},
        }
    )


async def make_pair(model_dir, transport, behaviour=lambda attempt: "ok"):
    cfg = config(transport)
    prefill = await PrefillWorker.start(cfg, str(model_dir))
    handle = FakePrefillHandle(prefill, behaviour)
    decode = await DecodeWorker.start(cfg, str(model_dir), handle)
    return prefill, decode, handle


def task(rid="r1", prompt=PROMPT, params=GREEDY, route=Route.REMOTE):
    return GenerateTask(rid, tuple(prompt), params, route, time.time() + 30, tuple(hash_full_blocks(prompt, 16)))


async def run_to_end(decode: DecodeWorker, t: GenerateTask):
    items = [item async for item in decode.generate(t)]
    return items[0], [tok for batch in items[1:] for o in batch for tok in o.new_token_ids]


async def assert_idle(*workers):
    for _ in range(100):
        stats = [w.engine.stats() for w in workers]
        if all(s.kv_blocks_used == 0 and s.active_requests == 0 for s in stats):
            break
        await asyncio.sleep(0.02)
    for w in workers:
        assert w.engine.stats().kv_blocks_used == 0, w
        assert await w.engine.check_integrity()
    for w in workers:  # every lease ended on both sides
        leases = w.receiver.leases if isinstance(w, DecodeWorker) else w.sender.leases
        assert len(leases) == 0


@pytest.fixture(scope="module")
def expected(demo_model):
    engine = LLMEngine(EngineConfig(model=str(demo_model), cache=CacheConfig(num_blocks=64)))
    return engine.generate([PROMPT], GREEDY)[0]["token_ids"]


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("transport", ["grpc", "gloo"])
def test_remote_prefill_matches_offline(demo_model, expected, transport):
    async def main():
        prefill, decode, _handle = await make_pair(demo_model, transport)
        try:
            started, ids = await run_to_end(decode, task())
            first_bytes = decode.stats().transfers.transfer_bytes
            # same prompt again: the decode side's prefix-cache hits are not transferred again
            _, ids2 = await run_to_end(decode, task("r2"))
            await assert_idle(prefill, decode)
            scaling = decode.autoscaling_stats(), prefill.autoscaling_stats()
            return started, ids, ids2, decode.stats(), prefill.stats(), first_bytes, scaling
        finally:
            decode.shutdown()
            prefill.shutdown()

    started, ids, ids2, dstats, pstats, first_bytes, (dscaling, pscaling) = run(main())
    assert started.route is Route.REMOTE
    assert ids == expected and ids2 == expected
    assert dstats.transfers.transfers == 2 and dstats.transfers.local_fallbacks == 0
    assert pstats.transfers.last_transport == dstats.transfers.last_transport == transport
    # PROMPT is 70 tokens = 5 blocks; the second transfer skips the 4 full blocks cached on the decode side
    per_block = first_bytes // 5
    assert first_bytes == 5 * per_block and dstats.transfers.transfer_bytes - first_bytes == per_block
    # What the autoscaler reads: the class mix (prompt tokens handed to the prefill pool) on the decode side; the
    # prompt tokens prefilled, the engine time they took and the replica's measured start-up on the prefill side.
    assert dscaling["remote_prompt_tokens"] == pscaling["prompt_tokens"] == 2 * len(PROMPT)
    assert pscaling["busy_s"] > 0 and pscaling["startup_s"] > 0 and pscaling["queued_prefill_tokens"] == 0


def test_failed_prefill_is_retried(demo_model, expected):
    async def main():
        prefill, decode, handle = await make_pair(demo_model, "grpc", lambda attempt: "fail" if attempt == 0 else "ok")
        try:
            _, ids = await run_to_end(decode, task())
            await assert_idle(prefill, decode)
            return ids, decode.stats(), handle.calls
        finally:
            decode.shutdown()
            prefill.shutdown()

    ids, stats, calls = run(main())
    t = stats.transfers
    assert ids == expected and calls == 2
    assert (t.prefill_retries, t.transfer_failures, t.local_fallbacks, t.transfers) == (1, 1, 0, 1)


@pytest.mark.parametrize("how", ["fail", "hang"])
def test_prefill_pool_gone_falls_back_to_local(demo_model, expected, how):
    async def main():
        prefill, decode, _handle = await make_pair(demo_model, "grpc", lambda attempt: how)
        try:
            _, ids = await run_to_end(decode, task())
            await assert_idle(prefill, decode)
            return ids, decode.stats()
        finally:
            decode.shutdown()
            prefill.shutdown()

    ids, stats = run(main())
    t = stats.transfers
    assert ids == expected
    assert (t.prefill_retries, t.local_fallbacks, t.transfers) == (1, 1, 0)


@pytest.mark.parametrize("transport", ["grpc", "gloo"])
def test_cancel_mid_stream_frees_blocks_on_both_sides(demo_model, transport):
    async def main():
        prefill, decode, _ = await make_pair(demo_model, transport)
        try:
            gen = decode.generate(task(params=dataclasses.replace(GREEDY, max_tokens=500)))
            assert (await gen.__anext__()).route is Route.REMOTE
            await gen.__anext__()  # the first token: decode holds the request's blocks
            assert decode.engine.stats().kv_blocks_used > 0
            await gen.aclose()  # what Serve does when the client disconnects
            await assert_idle(prefill, decode)
        finally:
            decode.shutdown()
            prefill.shutdown()

    run(main())


def test_cancel_during_remote_prefill_frees_blocks_on_both_sides(demo_model):
    async def main():
        prefill, decode, _handle = await make_pair(demo_model, "grpc", lambda attempt: "hang")
        try:
            consumer = asyncio.ensure_future(run_to_end(decode, task()))
            await asyncio.sleep(0.3)  # reserved on decode, prefill call in flight
            assert decode.engine.stats().waiting_for_remote_kv == 1
            consumer.cancel()
            with pytest.raises(asyncio.CancelledError):
                await consumer
            await assert_idle(prefill, decode)
        finally:
            decode.shutdown()
            prefill.shutdown()

    run(main())


def test_local_route_does_not_touch_prefill(demo_model, expected):
    async def main():
        prefill, decode, handle = await make_pair(demo_model, "grpc")
        try:
            started, ids = await run_to_end(decode, task(route=Route.LOCAL))
            return started, ids, handle.calls, decode.autoscaling_stats()
        finally:
            decode.shutdown()
            prefill.shutdown()

    started, ids, calls, scaling = run(main())
    assert started.route is Route.LOCAL and ids == expected and calls == 0
    assert scaling["remote_prompt_tokens"] == 0  # a LOCAL prompt is the decode pool's work


def test_a_timed_out_attempt_cannot_touch_its_retry_on_the_same_prefill_replica(demo_model, expected):
    """Attempt 0's send is held on its worker thread past the prefill deadline (asyncio's timeout cannot stop a
    thread); the decode side retries, and attempt 1 runs on the same replica under the same request id. When
    the held send goes on, it must neither begin (its lease ended with the attempt) nor end attempt 1's
    request, whose blocks are then being sent."""
    seen: dict = {}
    held, zombie_done = threading.Event(), threading.Event()

    async def main():
        prefill, decode, handle = await make_pair(demo_model, "grpc")
        real_send = prefill.sender.send

        def send(lease, ids):
            if "zombie" not in seen:  # attempt 0
                seen["zombie"] = lease.lease_id
                held.wait(10)
                try:
                    return real_send(lease, ids)
                finally:
                    zombie_done.set()
            held.set()  # attempt 1: the held send goes on and ends before this one starts
            zombie_done.wait(10)
            time.sleep(0.3)  # time for an abort it sent to reach the engine thread
            seen["blocks_held_by_attempt_1"] = prefill.engine.stats().kv_blocks_used
            return real_send(lease, ids)

        prefill.sender.send = send
        try:
            _, ids = await run_to_end(decode, task())
            await assert_idle(prefill, decode)
            return ids, decode.stats(), handle.calls, prefill.sender.leases.outcome(seen["zombie"])
        finally:
            decode.shutdown()
            prefill.shutdown()

    ids, stats, calls, zombie = run(main())
    assert ids == expected and calls == 2
    assert (stats.transfers.prefill_retries, stats.transfers.transfers) == (1, 1)
    assert seen["blocks_held_by_attempt_1"] == 5  # PROMPT's 5 blocks, still attempt 1's
    assert zombie.state == LeaseState.ABORTED and zombie.reason == "prefill ended"  # refused, never begun
