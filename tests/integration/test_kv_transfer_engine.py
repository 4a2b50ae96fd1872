"""Disaggregated prefill -> KV transfer -> decode with real engines: the decode engine, starting
from the transferred KV, produces exactly the greedy tokens one engine produces on its own."""

from __future__ import annotations

import threading

import pytest
import torch

from cluster.config import SamplingParams
from cluster.engine.llm_engine import LLMEngine
from kv_transfer import (
    EngineReserver,
    KVReceiver,
    KVSender,
    KVTransferConfig,
    KVTransferError,
    LeaseState,
    PagedKV,
    engine_release,
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
    receiver = KVReceiver(PagedKV(decode.kv_cache), EngineReserver(decode, dlock), cfg).start()
    sender = KVSender(PagedKV(prefill.kv_cache), engine_release(prefill, plock), cfg)
    try:
        lease = receiver.open_lease("r", prompt_token_ids=prompt, context=greedy)
        assert lease is not None
        assert lease.first_block == (2 if prefix_hit else 0)
        assert lease.num_blocks == len(held) - lease.first_block
        assert set(lease.block_ids).isdisjoint(filler)
        result = sender.send(lease, held[lease.first_block :], first_token_id=first[0])
        assert result.transport == transport
        assert receiver.wait(lease.lease_id, 5).ok
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


def test_failed_transfers_give_every_engine_block_back(demo_model):
    """Expiry, a refused commit, and the fallback hook, against a real decode engine."""
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompt = random_prompts(1, [40], vocab=512, seed=5)[0]
    decode, lock = LLMEngine(engine_config(demo_model, num_blocks=32)), threading.Lock()
    pool = decode.block_pool
    cfg = KVTransferConfig(transport="grpc", **dict(CONFIG, lease_ttl_s=0.5, reaper_interval_s=0.02))
    src_kv = torch.randn_like(decode.kv_cache)
    with (
        KVReceiver(PagedKV(decode.kv_cache), EngineReserver(decode, lock), cfg).start() as receiver,
        KVSender(PagedKV(src_kv), None, cfg) as sender,
    ):
        lease = receiver.open_lease("expire", prompt_token_ids=prompt, context=greedy)
        assert pool.num_free_blocks == pool.num_blocks - lease.num_blocks
        assert receiver.wait(lease.lease_id, 3).state == LeaseState.EXPIRED
        assert "expire" not in decode.requests and pool.num_free_blocks == pool.num_blocks

        lease = receiver.open_lease("no-token", prompt_token_ids=prompt, context=greedy)
        with pytest.raises(KVTransferError, match="commit failed: ValueError"):
            sender.send(lease, list(range(lease.num_blocks)), first_token_id=None)
        pool.check_integrity()
        assert "no-token" not in decode.requests and pool.num_free_blocks == pool.num_blocks

    # on_failed=fallback_to_local_prefill: the request survives a failed transfer and is prefilled here.
    reference = LLMEngine(engine_config(demo_model, num_blocks=32))
    reference.add_request("r", prompt, greedy)
    expected = run_to_end(reference, threading.Lock(), "r")
    reserver = EngineReserver(decode, lock, on_failed=decode.fallback_to_local_prefill)
    with KVReceiver(PagedKV(decode.kv_cache), reserver, cfg).start() as receiver:
        lease = receiver.open_lease("r", prompt_token_ids=prompt, context=greedy)
        receiver.abort(lease.lease_id, "prefill replica died")
    assert run_to_end(decode, lock, "r") == expected
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks
