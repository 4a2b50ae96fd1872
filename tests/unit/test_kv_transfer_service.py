"""KV transfer in one process over loopback gRPC/gloo: round trips, refusals, expiry, races.

Nothing here needs a second process; the multi-process and fault tests are in
tests/integration/test_kv_transfer_procs.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence

import pytest
import torch

from cluster.engine.block_pool import BlockPool
from kv_transfer import (
    KVReceiver,
    KVSender,
    KVTransferConfig,
    LayoutMismatchError,
    Lease,
    LeaseEndedError,
    LeaseState,
    LeaseTable,
    PagedKV,
    PeerUnavailableError,
    Release,
    TransportError,
    WireFormatError,
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


def pool_release(pool: BlockPool, lock: threading.Lock) -> Release:
    """Sender-side release over a bare pool: drops the reference the sender held for the transfer."""

    def release(request_id: str, block_ids: Sequence[int]) -> None:
        with lock:
            pool.release(block_ids)

    return release


class Side:
    """One worker's pool + KV tensor + lock. On the receiving side the test is the blocks' owner:
    it reserves them (``reserve``), opens the lease on them, and frees them after the lease ended."""

    def __init__(self, seed: int | None, **kw):
        self.kv = make_kv(seed, **kw)
        self.pool = BlockPool(self.kv.shape[2])
        self.lock = threading.Lock()

    def reserve(self, n: int) -> list[int]:
        with self.lock:
            ids = self.pool.allocate(n)
        assert ids is not None, f"no {n} free blocks"
        return ids

    def open_lease(self, receiver: KVReceiver, request_id: str, n: int, **kw) -> Lease:
        return receiver.open_lease(request_id, self.reserve(n), **kw)

    def end(self, receiver: KVReceiver, lease: Lease) -> None:
        """What the owner does on every exit: end the lease (a no-op if it has ended), then reuse the blocks."""
        receiver.abort(lease.lease_id, "owner is done with the blocks")
        with self.lock:
            self.pool.release(lease.block_ids)

    def num_free(self) -> int:
        with self.lock:
            return self.pool.num_free_blocks

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
    receiver = KVReceiver(PagedKV(dst.kv), config(transport)).start()
    sender = KVSender(PagedKV(src.kv), pool_release(src.pool, src.lock), config(transport))
    yield receiver, sender, dst, src
    sender.close()
    receiver.close()


def hold_source(src: Side, n: int) -> list[int]:
    with src.lock:
        ids = src.pool.allocate(n + 3)
        src.pool.release(ids[:3])  # source ids differ from the receiver's
    return ids[3:][::-1]


@pytest.mark.parametrize("pair", ["grpc", "gloo"], indirect=True)
def test_round_trip_in_process(pair):
    receiver, sender, dst, src = pair
    for i, n in enumerate((7, 1, 12)):
        src_ids = hold_source(src, n)
        lease = dst.open_lease(receiver, f"r{i}", n)
        result = sender.send(lease, src_ids)
        assert result.transport == sender.config.transport and result.num_blocks == n
        assert receiver.outcome(lease.lease_id).state == LeaseState.COMPLETED  # set before send returns
        assert receiver.wait(lease.lease_id, 2).ok
        assert torch.equal(dst.kv[:, :, list(lease.block_ids)], src.kv[:, :, src_ids])
        assert dst.num_free() == dst.pool.num_blocks - n  # the receiver freed nothing: the blocks are ours
        dst.end(receiver, lease)
    assert dst.all_free() and src.all_free()
    assert sender.metrics.get("transfers_sent", sender.config.transport) == 3
    assert receiver.metrics.get("transfers_received", "all") == 3


def test_layout_mismatch_is_refused_before_any_block_moves():
    dst, src = Side(None), Side(seed=1, head_dim=16)
    before = dst.kv.clone()
    receiver = KVReceiver(PagedKV(dst.kv), config()).start()
    sender = KVSender(PagedKV(src.kv), pool_release(src.pool, src.lock), config())
    try:
        lease = dst.open_lease(receiver, "r", 4)
        with pytest.raises(LayoutMismatchError, match="head_dim is 8 here but 16 on the peer"):
            sender.send(lease, hold_source(src, 4))
        assert torch.equal(dst.kv, before)
        assert src.all_free()  # the sender released its blocks
        assert receiver.abort(lease.lease_id) is True
        dst.end(receiver, lease)
        assert dst.all_free()
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
    receiver, sender, dst, src = pair
    lease = dst.open_lease(receiver, "r", 4)
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
    dst.end(receiver, lease)  # idempotent either way
    assert dst.all_free()


def test_short_stream_aborts_the_lease(pair):
    """A stream that ends before the lease's last block is a sender that died (gRPC can end it quietly)."""
    receiver, sender, dst, src = pair
    lease = dst.open_lease(receiver, "r", 4)
    with pytest.raises(PeerUnavailableError, match="ended after 2 of 4 blocks"):
        _push_raw(receiver, [_chunk(lease.lease_id, 0, src.kv[:, :, :2].contiguous())])
    assert receiver.wait(lease.lease_id, 1).state == LeaseState.ABORTED
    with pytest.raises(LeaseEndedError, match="aborted"):
        receiver.complete(lease.lease_id)
    dst.end(receiver, lease)
    assert dst.all_free()


def test_completion_with_blocks_missing_is_refused(pair):
    receiver, sender, dst, src = pair
    lease = dst.open_lease(receiver, "r", 4)
    receiver.write(lease.lease_id, 0, src.kv[:, :, :2].contiguous())
    with pytest.raises(LeaseEndedError, match="2 of 4 blocks missing"):
        receiver.complete(lease.lease_id)
    assert receiver.wait(lease.lease_id, 1).state == LeaseState.ABORTED
    dst.end(receiver, lease)
    assert dst.all_free()


def test_abort_stops_writes_and_leaves_the_blocks_to_their_owner(pair):
    receiver, sender, dst, src = pair
    lease = dst.open_lease(receiver, "r", 4)
    receiver.write(lease.lease_id, 0, src.kv[:, :, :2].contiguous())
    assert receiver.outcome(lease.lease_id) is None  # active
    assert receiver.abort(lease.lease_id, "client went away") is True
    out = receiver.outcome(lease.lease_id)
    assert out.state == LeaseState.ABORTED and out.reason == "client went away"
    before = dst.kv.clone()
    with pytest.raises(LeaseEndedError, match="already aborted: client went away"):
        receiver.write(lease.lease_id, 2, src.kv[:, :, 2:4].contiguous())
    with pytest.raises(LeaseEndedError):
        receiver.complete(lease.lease_id)
    with pytest.raises(LeaseEndedError):
        sender.send(lease, hold_source(src, 4))
    assert torch.equal(dst.kv, before), "a write landed after abort returned"
    assert src.all_free()
    assert dst.num_free() == dst.pool.num_blocks - 4  # nothing was freed for us
    assert receiver.abort(lease.lease_id) is False
    dst.end(receiver, lease)
    assert dst.all_free()


def test_lease_left_to_expire_ends_on_both_sides(pair):
    receiver, sender, dst, src = pair
    lease = dst.open_lease(receiver, "r", 5, ttl_s=0.5)
    t0 = time.monotonic()
    out = receiver.wait(lease.lease_id, 3)
    assert out.state == LeaseState.EXPIRED and time.monotonic() - t0 < 1.5
    assert receiver.metrics.get("leases_expired", "all") == 1
    assert dst.num_free() == dst.pool.num_blocks - 5  # still the owner's until it frees them
    assert receiver.abort(lease.lease_id) is False
    src_ids = hold_source(src, 5)
    with pytest.raises(LeaseEndedError):
        sender.send(lease, src_ids)
    assert src.all_free()
    dst.end(receiver, lease)
    assert dst.all_free()
    # the survivor goes on: another transfer works
    lease2 = dst.open_lease(receiver, "r2", 2)
    sender.send(lease2, hold_source(src, 2))
    assert receiver.wait(lease2.lease_id, 1).ok
    dst.end(receiver, lease2)
    assert dst.all_free() and src.all_free()


@pytest.mark.parametrize("pair", ["grpc", "gloo"], indirect=True)
def test_abort_racing_completion(pair):
    """The receiver aborts while the sender completes: exactly one outcome, every block accounted for."""
    receiver, sender, dst, src = pair
    outcomes = {LeaseState.COMPLETED: 0, LeaseState.ABORTED: 0}
    for i in range(12):
        lease = dst.open_lease(receiver, f"r{i}", 3)
        src_ids = hold_source(src, 3)
        aborter = threading.Timer(0.002 * (i % 6), receiver.abort, args=(lease.lease_id, "client went away"))
        aborter.start()
        try:
            sender.send(lease, src_ids)
        except LeaseEndedError as e:
            assert "aborted" in str(e)
        aborter.join()
        out = receiver.wait(lease.lease_id, 2)
        outcomes[out.state] += 1
        sender.abort(lease)  # late abort from the other side: a no-op
        assert receiver.outcome(lease.lease_id) == out
        dst.end(receiver, lease)
        assert src.all_free() and dst.all_free()
    assert sum(outcomes.values()) == 12
    print("abort/complete race outcomes:", outcomes)


def test_abort_is_idempotent_from_either_side(pair):
    receiver, sender, dst, src = pair
    lease = dst.open_lease(receiver, "r", 3)
    assert sender.abort(lease, "prefill failed") is False  # no send in flight here; the receiver is told
    assert receiver.wait(lease.lease_id, 1).state == LeaseState.ABORTED
    assert "prefill failed" in receiver.outcome(lease.lease_id).reason
    assert receiver.abort(lease.lease_id) is False
    assert sender.abort(lease) is False
    dst.end(receiver, lease)
    assert dst.all_free()


def test_open_lease_checks_the_block_ids_it_is_given(pair):
    receiver, sender, dst, src = pair
    n = SHAPE["blocks"]
    for bad, match in [
        ([0, n], rf"block ids \[{n}\] are outside this sink's \[0, {n}\)"),
        ([-1, 2], r"block ids \[-1\] are outside"),
        ([3, 5, 3], r"block ids \[3\] appear more than once"),
    ]:
        with pytest.raises(ValueError, match=match):
            receiver.open_lease("bad", bad)
    with pytest.raises(ValueError, match="first_block"):
        receiver.open_lease("bad", [1], first_block=-1)
    with pytest.raises(ValueError, match="ttl_s"):
        receiver.open_lease("bad", [1], ttl_s=0)
    assert len(receiver.leases) == 0
    lease = receiver.open_lease("r", (7, 2), first_block=3, ttl_s=1.5)
    assert lease.block_ids == (7, 2) and lease.first_block == 3 and lease.receiver_addr == receiver.address
    assert 1.0 < lease.time_left() <= 1.5 and lease.receiver_id == receiver.receiver_id
    default = receiver.open_lease("r2", [])  # nothing to move (everything was a local hit): still a lease
    assert 2.5 < default.time_left() <= receiver.config.lease_ttl_s
    sender.send(default, [])
    assert receiver.outcome(default.lease_id).state == LeaseState.COMPLETED
    receiver.abort(lease.lease_id)
    assert dst.all_free()  # the test never took blocks from its pool: the receiver does not either


def test_open_lease_needs_a_running_receiver():
    dst = Side(None)
    receiver = KVReceiver(PagedKV(dst.kv), config())
    with pytest.raises(RuntimeError, match="before start"):
        receiver.open_lease("r", [1])
    receiver.start()
    receiver.close()
    with pytest.raises(LeaseEndedError, match="shutting down"):
        receiver.open_lease("r", [1])
    receiver.close()  # idempotent


def test_close_aborts_open_leases(pair):
    receiver, sender, dst, src = pair
    lease = dst.open_lease(receiver, "r", 2)
    receiver.close()
    out = receiver.outcome(lease.lease_id)
    assert out.state == LeaseState.ABORTED and "shutting down" in out.reason
    assert len(receiver.leases) == 0
    dst.end(receiver, lease)
    assert dst.all_free()


def test_transport_choice():
    assert choose_transport("auto", ("nccl", "gloo", "grpc"), ("nccl", "gloo", "grpc")) == "nccl"
    assert choose_transport("auto", ("gloo", "grpc"), ("nccl", "gloo", "grpc")) == "gloo"
    assert choose_transport("auto", ("gloo", "grpc"), ("grpc",)) == "grpc"
    with pytest.raises(TransportError, match="nccl needs CUDA"):
        choose_transport("nccl", ("gloo", "grpc"), ("gloo", "grpc"))


def test_nccl_on_cpu_is_refused_with_a_clear_error():
    dst, src = Side(None), Side(seed=1)
    receiver = KVReceiver(PagedKV(dst.kv), config()).start()
    sender = KVSender(PagedKV(src.kv), pool_release(src.pool, src.lock), config("nccl"))
    try:
        lease = dst.open_lease(receiver, "r", 2)
        with pytest.raises(TransportError, match="'nccl' is not available on both sides"):
            sender.send(lease, hold_source(src, 2))
        assert receiver.wait(lease.lease_id, 1).state == LeaseState.ABORTED
        dst.end(receiver, lease)
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
    receiver, sender, dst, src = pair
    jobs = []
    for i in range(6):
        src_ids = hold_source(src, 3)
        lease = dst.open_lease(receiver, f"r{i}", 3)
        jobs.append((lease, src_ids, sender.submit(lease, src_ids)))
    for lease, src_ids, future in jobs:
        assert future.result(timeout=10).num_blocks == 3
        assert receiver.wait(lease.lease_id, 2).ok
        assert torch.equal(dst.kv[:, :, list(lease.block_ids)], src.kv[:, :, src_ids])
        dst.end(receiver, lease)
    assert dst.all_free() and src.all_free()


def test_receiver_caps_collective_groups_and_evicted_senders_rejoin():
    dst, a, b = Side(None), Side(seed=1), Side(seed=2)
    receiver = KVReceiver(PagedKV(dst.kv), config("gloo", max_peer_groups=1)).start()
    senders = [KVSender(PagedKV(s.kv), pool_release(s.pool, s.lock), config("gloo")) for s in (a, b)]
    try:
        for i, (side, sender) in enumerate([(a, senders[0]), (b, senders[1]), (a, senders[0])]):
            src_ids = hold_source(side, 2)
            lease = dst.open_lease(receiver, f"r{i}", 2)
            assert sender.send(lease, src_ids).transport == "gloo"  # the third one rejoins
            assert torch.equal(dst.kv[:, :, list(lease.block_ids)], side.kv[:, :, src_ids])
            dst.end(receiver, lease)
        assert receiver.service.num_groups == 1
        assert dst.all_free() and a.all_free() and b.all_free()
    finally:
        for sender in senders:
            sender.close()
        receiver.close()


# ---- memory: nothing per lease outlives the lease (beyond the bounded outcome record) ---------


def _containers_holding(obj: object, lease_ids: set[str]) -> list[str]:
    """Attributes of ``obj`` (dicts, lists, sets ...) that still hold one of ``lease_ids`` - as a key, an
    item or an item's ``lease_id``. Lease tables are checked on their own."""
    found = []
    for name, value in vars(obj).items():
        if isinstance(value, LeaseTable) or (isinstance(obj, LeaseTable) and name == "_ended"):
            continue
        if isinstance(value, dict):
            items = [*value.keys(), *value.values()]
        elif isinstance(value, (list, tuple, set, frozenset, deque)):
            items = list(value)
        else:
            continue
        if any(_lease_id_of(item) in lease_ids for item in items):
            found.append(f"{type(obj).__name__}.{name}")
    return found


def _lease_id_of(item: object) -> str | None:
    key = getattr(item, "lease_id", item)
    return key if isinstance(key, str) else None


def test_lease_records_do_not_accumulate():
    """1,000 leases through a real receiver/sender pair - half completed, the rest aborted by either side
    or expired - leave no active lease, at most ``max_ended`` outcomes, and no other per-lease entry."""
    dst, src = Side(None), Side(seed=1)
    receiver = KVReceiver(PagedKV(dst.kv), config()).start()
    sender = KVSender(PagedKV(src.kv), pool_release(src.pool, src.lock), config())
    receiver.leases.max_ended = sender.leases.max_ended = 32
    lease_ids: set[str] = set()
    counts = {"completed": 0, "aborted": 0, "expired": 0}
    expiring: list[Lease] = []
    try:
        for i in range(1000):
            if i % 50 == 49:  # left alone: the reaper expires it
                lease = dst.open_lease(receiver, f"r{i}", 1, ttl_s=0.05)
                expiring.append(lease)
                lease_ids.add(lease.lease_id)
                continue
            lease = dst.open_lease(receiver, f"r{i}", 1)
            lease_ids.add(lease.lease_id)
            if i % 2 == 0:
                sender.send(lease, hold_source(src, 1))
                assert receiver.outcome(lease.lease_id).state == LeaseState.COMPLETED
                counts["completed"] += 1
            elif i % 8 == 1:
                assert receiver.abort(lease.lease_id, "client went away")
                counts["aborted"] += 1
            elif i % 8 == 3:
                sender.abort(lease, "prefill failed")  # AbortLease over gRPC
                assert receiver.outcome(lease.lease_id).state == LeaseState.ABORTED
                counts["aborted"] += 1
            else:  # aborted by the owner, then a late sender fails on it
                receiver.abort(lease.lease_id)
                with pytest.raises(LeaseEndedError):
                    sender.send(lease, hold_source(src, 1))
                counts["aborted"] += 1
            dst.end(receiver, lease)
        end = time.monotonic() + 3
        while receiver.metrics.get("leases_expired", "all") < len(expiring) and time.monotonic() < end:
            time.sleep(0.02)
        for lease in expiring:  # their outcomes may be forgotten already (max_ended): the metrics count them
            assert receiver.abort(lease.lease_id) is False
            counts["expired"] += 1
            dst.end(receiver, lease)
        assert counts == {"completed": 500, "aborted": 480, "expired": 20}
        assert receiver.metrics.get("transfers_received", "all") == 500
        assert receiver.metrics.get("leases_aborted", "all") == 480
        assert receiver.metrics.get("leases_expired", "all") == 20
        assert dst.all_free() and src.all_free()

        for table in (receiver.leases, sender.leases):
            assert len(table) == 0 and not table._active
            assert len(table._ended) == table.max_ended == 32  # bounded: the oldest outcomes were dropped
            assert not hasattr(table, "_finished") and not hasattr(table, "poll_finished")
        assert sum(receiver.outcome(lease_id) is not None for lease_id in lease_ids) == 32
        for obj in (receiver, receiver.service, receiver.leases, sender, sender.leases):
            assert _containers_holding(obj, lease_ids) == []
        assert not hasattr(receiver, "_started") and not hasattr(receiver, "poll_finished")
        assert not hasattr(sender, "poll_finished") and not hasattr(sender, "open_lease")
    finally:
        sender.close()
        receiver.close()


def test_kv_transfer_does_not_import_the_engine():
    code = "import sys, kv_transfer; print(sorted(m for m in sys.modules if m.startswith('cluster.engine')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
