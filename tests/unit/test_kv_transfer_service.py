"""KV transfer in one process over loopback gRPC/gloo: round trips, refusals, expiry, races.

Nothing here needs a second process; the multi-process and fault tests are in
tests/integration/test_kv_transfer_procs.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cluster.engine.block_pool import BlockPool
from kv_transfer import (
    KVReceiver,
    KVSender,
    KVTransferConfig,
    LayoutMismatchError,
    LeaseEndedError,
    LeaseState,
    PagedKV,
    PeerUnavailableError,
    PoolReserver,
    TransportError,
    WireFormatError,
    pool_release,
    wire,
)
from kv_transfer.rpc import Client
from kv_transfer.transports import choose_transport

SHAPE = dict(layers=2, blocks=24, block_size=4, heads=2, head_dim=8)


def make_kv(seed: int | None, dtype=torch.float32, head_dim=SHAPE["head_dim"]) -> torch.Tensor:
    shape = (SHAPE["layers"], 2, SHAPE["blocks"], SHAPE["block_size"], SHAPE["heads"], head_dim)
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


class Side:
    """One worker's pool + KV tensor + lock."""

    def __init__(self, seed: int | None, **kw):
        self.kv = make_kv(seed, **kw)
        self.pool = BlockPool(self.kv.shape[2])
        self.lock = threading.Lock()

    def all_free(self) -> bool:
        with self.lock:
            self.pool.check_integrity()
            return self.pool.num_free_blocks == self.pool.num_blocks


def config(transport="grpc", **kw) -> KVTransferConfig:
    base = dict(
        transport=transport,
        lease_ttl_s=3.0,
        rpc_timeout_s=2.0,
        connect_timeout_s=3.0,
        collective_timeout_s=3.0,
        grpc_chunk_bytes=2048,
        collective_chunk_bytes=4096,
        reaper_interval_s=0.02,
    )
    base.update(kw)
    return KVTransferConfig(**base)


@pytest.fixture
def pair(request):
    transport = getattr(request, "param", "grpc")
    dst, src = Side(None), Side(seed=1)
    reserver = PoolReserver(dst.pool, dst.lock)
    receiver = KVReceiver(PagedKV(dst.kv), reserver, config(transport)).start()
    sender = KVSender(PagedKV(src.kv), pool_release(src.pool, src.lock), config(transport))
    yield receiver, sender, dst, src, reserver
    sender.close()
    receiver.close()


def hold_source(src: Side, n: int) -> list[int]:
    with src.lock:
        ids = src.pool.allocate(n + 3)
        src.pool.release(ids[:3])  # source ids differ from the receiver's
    return ids[3:][::-1]


@pytest.mark.parametrize("pair", ["grpc", "gloo"], indirect=True)
def test_round_trip_in_process(pair):
    receiver, sender, dst, src, reserver = pair
    for i, n in enumerate((7, 1, 12)):
        src_ids = hold_source(src, n)
        lease = receiver.open_lease(f"r{i}", num_blocks=n)
        result = sender.send(lease, src_ids, first_token_id=9)
        assert result.transport == sender.config.transport and result.num_blocks == n
        out = receiver.wait(lease.lease_id, 2)
        assert out.ok and out.first_token_id == 9
        assert torch.equal(dst.kv[:, :, list(lease.block_ids)], src.kv[:, :, src_ids])
        reserver.release_committed(f"r{i}")
    assert dst.all_free() and src.all_free()
    assert sender.metrics.get("transfers_sent", sender.config.transport) == 3
    assert receiver.metrics.get("transfers_received", "all") == 3


def test_layout_mismatch_is_refused_before_any_block_moves():
    dst, src = Side(None), Side(seed=1, head_dim=16)
    before = dst.kv.clone()
    receiver = KVReceiver(PagedKV(dst.kv), PoolReserver(dst.pool, dst.lock), config()).start()
    sender = KVSender(PagedKV(src.kv), pool_release(src.pool, src.lock), config())
    try:
        lease = receiver.open_lease("r", num_blocks=4)
        with pytest.raises(LayoutMismatchError, match="head_dim is 8 here but 16 on the peer"):
            sender.send(lease, hold_source(src, 4))
        assert torch.equal(dst.kv, before)
        assert src.all_free()  # the sender released its blocks
        assert receiver.abort(lease.lease_id) is True and dst.all_free()
    finally:
        sender.close()
        receiver.close()


def _push_raw(receiver: KVReceiver, messages: list[bytes]):
    client = Client(receiver.address, 1 << 22)
    try:
        return client.stream("PushBlocks", iter(messages), wire.PushReply, 2.0)
    finally:
        client.close()


def _chunk(lease_id: str, start: int, t: torch.Tensor) -> bytes:
    return wire.encode(wire.BlockChunk(lease_id, start, wire.TensorPayload.from_tensor(t)))


@pytest.mark.parametrize(
    "bad, expect",
    [
        ("not msgpack", "not a msgpack message"),
        ("truncated", "truncated"),
        ("wrong head_dim", "head_dim is 4, want 8"),
        ("wrong dtype", "dtype is bfloat16"),
        ("outside lease", "outside lease"),
    ],
)
def test_malformed_block_data_is_refused_before_any_block_is_written(pair, bad, expect):
    receiver, sender, dst, src, _ = pair
    lease = receiver.open_lease("r", num_blocks=4)
    good = src.kv[:, :, :2].contiguous()
    if bad == "not msgpack":
        msgs = [b"\x93garbage"]
    elif bad == "truncated":
        msgs = [_chunk(lease.lease_id, 0, good)[:-100]]
    elif bad == "wrong head_dim":
        msgs = [_chunk(lease.lease_id, 0, good[..., :4].contiguous())]
    elif bad == "wrong dtype":
        msgs = [_chunk(lease.lease_id, 0, good.to(torch.bfloat16))]
    else:
        msgs = [_chunk(lease.lease_id, 3, good)]
    before = dst.kv.clone()
    with pytest.raises(WireFormatError, match=expect):
        _push_raw(receiver, msgs)
    assert torch.equal(dst.kv, before)
    if bad not in ("not msgpack", "truncated"):  # the lease id was readable: the lease is aborted at once
        assert receiver.wait(lease.lease_id, 1).state == LeaseState.ABORTED
    receiver.abort(lease.lease_id)  # idempotent either way
    assert dst.all_free()


def test_short_stream_aborts_the_lease(pair):
    """A stream that ends before the lease's last block is a sender that died (gRPC can end it quietly)."""
    receiver, sender, dst, src, _ = pair
    lease = receiver.open_lease("r", num_blocks=4)
    with pytest.raises(PeerUnavailableError, match="ended after 2 of 4 blocks"):
        _push_raw(receiver, [_chunk(lease.lease_id, 0, src.kv[:, :, :2].contiguous())])
    assert receiver.wait(lease.lease_id, 1).state == LeaseState.ABORTED
    with pytest.raises(LeaseEndedError, match="aborted"):
        receiver.complete(lease.lease_id, 1)
    assert dst.all_free()


def test_completion_with_blocks_missing_is_refused(pair):
    receiver, sender, dst, src, _ = pair
    lease = receiver.open_lease("r", num_blocks=4)
    receiver.write(lease.lease_id, 0, src.kv[:, :, :2].contiguous())
    with pytest.raises(LeaseEndedError, match="2 of 4 blocks missing"):
        receiver.complete(lease.lease_id, 1)
    assert receiver.wait(lease.lease_id, 1).state == LeaseState.ABORTED
    assert dst.all_free()


def test_lease_left_to_expire_frees_blocks_on_both_sides(pair):
    receiver, sender, dst, src, _ = pair
    lease = receiver.open_lease("r", num_blocks=5, ttl_s=0.5)
    t0 = time.monotonic()
    out = receiver.wait(lease.lease_id, 3)
    assert out.state == LeaseState.EXPIRED and time.monotonic() - t0 < 1.5
    assert dst.all_free()
    src_ids = hold_source(src, 5)
    with pytest.raises(LeaseEndedError):
        sender.send(lease, src_ids)
    assert src.all_free()
    # the survivor goes on: another transfer works
    lease2 = receiver.open_lease("r2", num_blocks=2)
    sender.send(lease2, hold_source(src, 2), first_token_id=1)
    assert receiver.wait(lease2.lease_id, 1).ok


@pytest.mark.parametrize("pair", ["grpc", "gloo"], indirect=True)
def test_abort_racing_completion(pair):
    """The receiver aborts while the sender completes: exactly one outcome, every block accounted for."""
    receiver, sender, dst, src, reserver = pair
    outcomes = {LeaseState.COMPLETED: 0, LeaseState.ABORTED: 0}
    for i in range(12):
        lease = receiver.open_lease(f"r{i}", num_blocks=3)
        src_ids = hold_source(src, 3)
        aborter = threading.Timer(0.002 * (i % 6), receiver.abort, args=(lease.lease_id, "client went away"))
        aborter.start()
        try:
            sender.send(lease, src_ids, first_token_id=1)
        except LeaseEndedError as e:
            assert "aborted" in str(e)
        aborter.join()
        out = receiver.wait(lease.lease_id, 2)
        outcomes[out.state] += 1
        sender.abort(lease)  # late abort from the other side: a no-op
        if out.ok:
            reserver.release_committed(f"r{i}")
        assert src.all_free() and dst.all_free()
    assert sum(outcomes.values()) == 12
    print("abort/complete race outcomes:", outcomes)


def test_abort_is_idempotent_from_either_side(pair):
    receiver, sender, dst, src, _ = pair
    lease = receiver.open_lease("r", num_blocks=3)
    assert sender.abort(lease, "prefill failed") is False  # no send in flight here; the receiver is told
    assert receiver.wait(lease.lease_id, 1).state == LeaseState.ABORTED
    assert "prefill failed" in receiver.leases.outcome(lease.lease_id).reason
    assert receiver.abort(lease.lease_id) is False
    assert sender.abort(lease) is False
    assert dst.all_free()


def test_open_lease_returns_none_without_free_blocks(pair):
    receiver, sender, dst, _, _ = pair
    assert receiver.open_lease("big", num_blocks=SHAPE["blocks"] + 1) is None
    remote = sender.open_lease(receiver.address, "r", num_blocks=2, prompt_token_ids=[1, 2, 3])
    assert remote is not None and remote.num_blocks == 2 and remote.receiver_addr == receiver.address
    assert sender.open_lease(receiver.address, "big", num_blocks=SHAPE["blocks"]) is None
    receiver.abort(remote.lease_id)
    assert dst.all_free()


def test_transport_choice():
    assert choose_transport("auto", ("nccl", "gloo", "grpc"), ("nccl", "gloo", "grpc")) == "nccl"
    assert choose_transport("auto", ("gloo", "grpc"), ("nccl", "gloo", "grpc")) == "gloo"
    assert choose_transport("auto", ("gloo", "grpc"), ("grpc",)) == "grpc"
    with pytest.raises(TransportError, match="nccl needs CUDA"):
        choose_transport("nccl", ("gloo", "grpc"), ("gloo", "grpc"))


def test_nccl_on_cpu_is_refused_with_a_clear_error():
    dst, src = Side(None), Side(seed=1)
    receiver = KVReceiver(PagedKV(dst.kv), PoolReserver(dst.pool, dst.lock), config()).start()
    sender = KVSender(PagedKV(src.kv), pool_release(src.pool, src.lock), config("nccl"))
    try:
        lease = receiver.open_lease("r", num_blocks=2)
        with pytest.raises(TransportError, match="'nccl' is not available on both sides"):
            sender.send(lease, hold_source(src, 2))
        assert receiver.wait(lease.lease_id, 1).state == LeaseState.ABORTED
        assert src.all_free() and dst.all_free()
    finally:
        sender.close()
        receiver.close()


def test_config_is_validated():
    from cluster.errors import ConfigError

    with pytest.raises(ConfigError, match="transport 'rdma' is unknown"):
        KVTransferConfig(transport="rdma").validate()
    with pytest.raises(ConfigError, match="lease_ttl_s must be > 0"):
        KVTransferConfig(lease_ttl_s=0).validate()


def test_paged_kv_moves_whole_blocks():
    from kv_transfer import PagedKV

    kv = make_kv(seed=2)
    paged = PagedKV(kv)
    ids = [5, 0, 17]
    assert torch.equal(paged.gather(ids), kv[:, :, ids])
    out = torch.empty_like(kv[:, :, :3])
    assert paged.gather(ids, out) is out and torch.equal(out, kv[:, :, ids])
    dst = PagedKV(make_kv(None))
    dst.scatter([3, 9, 1], out)
    assert torch.equal(dst.kv[:, :, [3, 9, 1]], kv[:, :, ids])
    assert dst.kv[:, :, [0, 2, 4]].abs().sum() == 0
    with pytest.raises(ValueError, match="do not fit 2 blocks"):
        dst.scatter([1, 2], out)
    with pytest.raises(ValueError, match="duplicate"):
        dst.scatter([1, 1, 2], out)
    with pytest.raises(ValueError, match="out of range"):
        dst.scatter([1, 2, SHAPE["blocks"]], out)
    assert paged.layout.mismatch(dst.layout) is None


@pytest.mark.parametrize("pair", ["grpc", "gloo"], indirect=True)
def test_concurrent_sends_to_one_receiver(pair):
    receiver, sender, dst, src, reserver = pair
    jobs = []
    for i in range(6):
        src_ids = hold_source(src, 3)
        lease = receiver.open_lease(f"r{i}", num_blocks=3)
        jobs.append((lease, src_ids, sender.submit(lease, src_ids, first_token_id=i)))
    for lease, src_ids, future in jobs:
        assert future.result(timeout=10).num_blocks == 3
        assert receiver.wait(lease.lease_id, 2).first_token_id == int(lease.request_id[1:])
        assert torch.equal(dst.kv[:, :, list(lease.block_ids)], src.kv[:, :, src_ids])
        reserver.release_committed(lease.request_id)
    assert dst.all_free() and src.all_free()


def test_receiver_caps_collective_groups_and_evicted_senders_rejoin():
    dst, a, b = Side(None), Side(seed=1), Side(seed=2)
    reserver = PoolReserver(dst.pool, dst.lock)
    receiver = KVReceiver(PagedKV(dst.kv), reserver, config("gloo", max_peer_groups=1)).start()
    senders = [KVSender(PagedKV(s.kv), pool_release(s.pool, s.lock), config("gloo")) for s in (a, b)]
    try:
        for i, (side, sender) in enumerate([(a, senders[0]), (b, senders[1]), (a, senders[0])]):
            src_ids = hold_source(side, 2)
            lease = receiver.open_lease(f"r{i}", num_blocks=2)
            assert sender.send(lease, src_ids, first_token_id=1).transport == "gloo"  # the third one rejoins
            assert torch.equal(dst.kv[:, :, list(lease.block_ids)], side.kv[:, :, src_ids])
            reserver.release_committed(f"r{i}")
        assert len(receiver._groups) == 1
        assert dst.all_free() and a.all_free() and b.all_free()
    finally:
        for sender in senders:
            sender.close()
        receiver.close()
