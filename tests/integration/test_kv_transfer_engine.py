"""Disaggregated prefill -> KV transfer -> decode with real engines: the decode engine, starting
from the transferred KV, produces exactly the greedy tokens one engine produces on its own."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch

from cluster.config import SamplingParams
from cluster.engine.llm_engine import LLMEngine
from kv_transfer import (
    KVReceiver,
    KVSender,
    KVTransferConfig,
    KVTransferError,
    LayoutMismatchError,
    Lease,
    LeaseEndedError,
    LeaseState,
    PagedKV,
    Release,
)
from tests.helpers import engine_config, random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MAX_TOKENS = 12
CONFIG = dict(lease_ttl_s=10.0, rpc_timeout_s=5.0, grpc_chunk_bytes=8192, collective_chunk_bytes=16384)


def run_to_end(engine: LLMEngine, lock: threading.Lock, request_id: str) -> list[int]:
    tokens: list[int] = []
    while True:
        with lock:
            outs = engine.step()
        for out in outs:
            if out.request_id == request_id:
                tokens.extend(out.new_token_ids)
                if out.finished:
                    return tokens


def engine_release(engine: LLMEngine, lock: threading.Lock) -> Release:
    """Sender-side release for a prefill engine that held the prompt's blocks (``hold_kv_on_finish=True``)."""

    def release(request_id: str, block_ids: Sequence[int]) -> None:
        with lock:
            engine.release_kv(request_id)

    return release


def reserve_and_lease(
    receiver: KVReceiver, engine: LLMEngine, lock: threading.Lock, request_id: str, prompt, params
) -> Lease:
    """The decode side's part: reserve in its own engine, lease the blocks past its prefix-cache hits."""
    with lock:
        r = engine.reserve_remote_kv(request_id, list(prompt), params)
    assert r is not None, "no free blocks"
    skip = r.num_cached_tokens // engine.kv_layout.block_size
    return receiver.open_lease(request_id, r.block_ids[skip:], first_block=skip)


@pytest.mark.parametrize("transport, prefix_hit", [("gloo", False), ("grpc", True)])
def test_decode_engine_continues_exactly_from_transferred_kv(demo_model, transport, prefix_hit):
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompt = random_prompts(1, [45], vocab=512, seed=4)[0]  # 3 blocks of 16 (last one partial)
    no_lock = threading.Lock()

    reference = LLMEngine(engine_config(demo_model, num_blocks=32))
    reference.add_request("r", prompt, greedy)
    expected = run_to_end(reference, no_lock, "r")

    prefill, plock = LLMEngine(engine_config(demo_model, num_blocks=32)), threading.Lock()
    decode, dlock = LLMEngine(engine_config(demo_model, num_blocks=48)), threading.Lock()  # pools may differ in size
    # Occupy the decode pool's first blocks so the KV lands in other block ids than on the prefill side.
    filler = decode.block_pool.allocate(7)
    if prefix_hit:  # the decode pool already caches the first 32 prompt tokens: only 1 block moves
        decode.add_request("warm", prompt[:32] + [1, 2], SamplingParams(max_tokens=1, temperature=0.0))
        run_to_end(decode, dlock, "warm")

    prefill.add_request(
        "r", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), hold_kv_on_finish=True
    )
    first = run_to_end(prefill, plock, "r")
    assert first == expected[:1]
    held = prefill.held_kv_blocks("r")

    cfg = KVTransferConfig(transport=transport, **CONFIG)
    receiver = KVReceiver(PagedKV(decode.kv_cache), cfg).start()
    sender = KVSender(PagedKV(prefill.kv_cache), engine_release(prefill, plock), cfg)
    try:
        lease = reserve_and_lease(receiver, decode, dlock, "r", prompt, greedy)
        assert lease.first_block == (2 if prefix_hit else 0)
        assert lease.num_blocks == len(held) - lease.first_block
        assert set(lease.block_ids).isdisjoint(filler)
        # prefill side: push its blocks past the decode side's hits; the first token travels in its own result
        result = sender.send(lease, held[lease.first_block :])
        assert result.transport == transport
        # decode side: the prefill side reported success; use the blocks only if the lease completed
        out = receiver.outcome(lease.lease_id)
        assert out is not None and out.state == LeaseState.COMPLETED
        with dlock:
            decode.complete_remote_kv("r", first[0], None)
        assert receiver.abort(lease.lease_id) is False  # ending a completed lease is a no-op
    finally:
        sender.close()
        receiver.close()

    assert run_to_end(decode, dlock, "r") == expected
    # The sender released its held blocks; the decode side still holds only the filler (and cached blocks).
    prefill.block_pool.check_integrity()
    assert prefill.block_pool.num_free_blocks == prefill.block_pool.num_blocks
    decode.block_pool.release(filler)
    decode.block_pool.check_integrity()
    assert decode.block_pool.num_free_blocks == decode.block_pool.num_blocks


def test_failed_transfers_leave_the_decision_to_the_decode_side(demo_model):
    """Expiry, a refused sender and an abort, against a real decode engine: the receiver frees nothing;
    the decode side ends the lease, then aborts the request or prefills it locally itself."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompt = random_prompts(1, [40], vocab=512, seed=5)[0]
    decode, lock = LLMEngine(engine_config(demo_model, num_blocks=32)), threading.Lock()
    pool = decode.block_pool
    cfg = KVTransferConfig(transport="grpc", **dict(CONFIG, lease_ttl_s=0.5, reaper_interval_s=0.02))
    src_kv = torch.randn_like(decode.kv_cache)
    wrong_kv = torch.randn(*decode.kv_cache.shape[:-1], 2 * decode.kv_cache.shape[-1]).to(decode.kv_cache.dtype)
    with (
        KVReceiver(PagedKV(decode.kv_cache), cfg).start() as receiver,
        KVSender(PagedKV(src_kv), None, cfg) as sender,
        KVSender(PagedKV(wrong_kv), None, cfg) as wrong_sender,
    ):
        # expiry: the blocks stay reserved until the decode side gives up on the request
        lease = reserve_and_lease(receiver, decode, lock, "expire", prompt, greedy)
        assert pool.num_free_blocks == pool.num_blocks - lease.num_blocks
        assert receiver.wait(lease.lease_id, 3).state == LeaseState.EXPIRED
        assert "expire" in decode.requests and pool.num_free_blocks == pool.num_blocks - lease.num_blocks
        with pytest.raises(LeaseEndedError):  # a late sender cannot write any more
            sender.send(lease, list(range(lease.num_blocks)))
        assert receiver.abort(lease.lease_id) is False
        with lock:
            decode.abort_request("expire")
        assert "expire" not in decode.requests and pool.num_free_blocks == pool.num_blocks

        # a sender the receiver refuses (layout): nothing written; the decode side ends the lease, aborts the request
        lease = reserve_and_lease(receiver, decode, lock, "refused", prompt, greedy)
        before = decode.kv_cache[:, :, list(lease.block_ids)].clone()
        with pytest.raises(KVTransferError) as info:
            wrong_sender.send(lease, list(range(lease.num_blocks)))
        assert isinstance(info.value, LayoutMismatchError)
        receiver.abort(lease.lease_id, "prefill failed")  # it may have expired already: a no-op then
        assert receiver.outcome(lease.lease_id).state in (LeaseState.ABORTED, LeaseState.EXPIRED)
        assert torch.equal(decode.kv_cache[:, :, list(lease.block_ids)], before)
        with lock:
            decode.abort_request("refused")
        pool.check_integrity()
        assert pool.num_free_blocks == pool.num_blocks

    # the decode side keeps the request after a failed transfer and prefills it locally instead
    reference = LLMEngine(engine_config(demo_model, num_blocks=32))
    reference.add_request("r", prompt, greedy)
    expected = run_to_end(reference, threading.Lock(), "r")
    with KVReceiver(PagedKV(decode.kv_cache), cfg).start() as receiver:
        lease = reserve_and_lease(receiver, decode, lock, "r", prompt, greedy)
        assert receiver.abort(lease.lease_id, "prefill replica died") is True  # before touching the blocks
        with lock:
            decode.fallback_to_local_prefill("r")
    assert run_to_end(decode, lock, "r") == expected
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks
