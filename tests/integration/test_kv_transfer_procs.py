"""KV transfer between two processes: bit-exact round trips and the fault cases.

The test process is one side, ``kv_peer.py`` in a subprocess the other. In every fault case
the survivor reports a clear error within the lease deadline, every block of its pool is back
(``check_integrity`` and all free; on the receiving side once the test, the blocks' owner, has
ended the lease and released them), and it runs another transfer afterwards.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from cluster.engine.block_pool import BlockPool
from kv_transfer import KVReceiver, KVSender, KVTransferError, Lease, LeaseState, PagedKV
from tests.integration.kv_peer import Peer, lease_from_line, make_kv, peer_config, pool_release

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TTL = 3.0
#: Slack on top of the deadline for the reaper, process scheduling and a loaded 2-core CI box.
SLACK = 2.0


class Pool:
    def __init__(self, kv: torch.Tensor):
        self.kv = kv
        self.pool = BlockPool(kv.shape[2])
        self.lock = threading.Lock()

    def open_lease(self, receiver: KVReceiver, request_id: str, n: int) -> Lease:
        """Reserves ``n`` blocks here (the test owns them) and leases them to a transfer."""
        with self.lock:
            ids = self.pool.allocate(n)
        assert ids is not None
        return receiver.open_lease(request_id, ids)

    def end(self, receiver: KVReceiver, lease: Lease) -> None:
        """The owner's exit: end the lease (a no-op once it ended), then take the blocks back."""
        receiver.abort(lease.lease_id, "owner is done with the blocks")
        with self.lock:
            self.pool.release(lease.block_ids)

    def assert_all_back(self) -> None:
        with self.lock:
            self.pool.check_integrity()
            assert self.pool.num_free_blocks == self.pool.num_blocks


def fragmented_receiver(transport: str, dtype: str = "float32", ttl: float = TTL):
    """A receiver whose free blocks are scattered, so leased ids differ from the sender's."""
    dst = Pool(make_kv(None, dtype))
    with dst.lock:
        ids = dst.pool.allocate(dst.pool.num_blocks)
        g = torch.Generator().manual_seed(0)
        scattered = [ids[i] for i in torch.randperm(len(ids), generator=g).tolist()]
        dst.pool.release(scattered[: len(ids) // 2])
        filler = scattered[len(ids) // 2 :]
    receiver = KVReceiver(PagedKV(dst.kv), peer_config(transport, ttl)).start()
    return receiver, dst, filler


def local_transfer_to(receiver: KVReceiver, dst: Pool, transport: str, dtype: str = "float32") -> None:
    """The survivor runs another transfer (a fresh in-process sender)."""
    src = Pool(make_kv(11, dtype))
    sender = KVSender(PagedKV(src.kv), pool_release(src.pool, src.lock), peer_config(transport, TTL))
    try:
        lease = dst.open_lease(receiver, "after", 5)
        with src.lock:
            ids = src.pool.allocate(5)
        sender.send(lease, ids)
        assert receiver.wait(lease.lease_id, 2).ok
        assert torch.equal(receiver.sink.kv[:, :, list(lease.block_ids)], src.kv[:, :, ids])
        dst.end(receiver, lease)
        src.assert_all_back()
    finally:
        sender.close()


@pytest.mark.parametrize("transport, dtype", [("gloo", "bfloat16"), ("grpc", "float32")])
def test_round_trip_between_processes_is_bit_exact(transport, dtype):
    receiver, dst, filler = fragmented_receiver(transport, dtype, ttl=20.0)
    peer = lease = None
    try:
        peer = Peer("sender", "--transport", transport, "--dtype", dtype, "--seed", "3", "--ttl", "20")
        peer.expect("started")
        lease = dst.open_lease(receiver, "req-1", 20)
        peer.send_lease(lease)
        src_ids = peer.expect("ready")["src"]
        sent = peer.expect("sent")
        assert sent["transport"] == transport
        assert peer.expect("done")["free"] == dst.pool.num_blocks  # the sender released every block
        out = receiver.wait(lease.lease_id, 5)
        assert out.ok and receiver.outcome(lease.lease_id).state == LeaseState.COMPLETED
        assert sorted(src_ids) != sorted(lease.block_ids) or src_ids != list(lease.block_ids)
        expected = make_kv(3, dtype)[:, :, src_ids]
        assert torch.equal(dst.kv[:, :, list(lease.block_ids)], expected)
        others = [b for b in range(dst.pool.num_blocks) if b not in lease.block_ids]
        assert not dst.kv[:, :, others].any(), "a block outside the lease was written"
    finally:
        if peer:
            peer.kill()
        if lease is not None:
            dst.end(receiver, lease)
        with dst.lock:
            dst.pool.release(filler)
        receiver.close()
    dst.assert_all_back()


@pytest.mark.parametrize("transport", ["gloo", "grpc"])
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_sender_killed_or_frozen_mid_transfer(transport, fault):
    receiver, dst, filler = fragmented_receiver(transport)
    peer = None
    try:
        peer = Peer("sender", "--transport", transport, "--seed", "3", "--ttl", str(TTL), "--stall-after", "1")
        peer.expect("started")
        lease = dst.open_lease(receiver, "req-1", 16)
        peer.send_lease(lease)
        peer.expect("stalled", timeout=30)
        end = time.monotonic() + 5
        while receiver.num_received(lease.lease_id) == 0 and time.monotonic() < end:
            time.sleep(0.01)
        assert receiver.num_received(lease.lease_id) > 0, "the fault must hit mid-transfer"
        t0 = time.monotonic()
        os.kill(peer.proc.pid, getattr(signal, fault))
        out = receiver.wait(lease.lease_id, lease.time_left() + SLACK)
        waited = time.monotonic() - t0
        print(f"{transport} sender {fault}: receiver saw {out.state.name} after {waited:.2f}s: {out.reason}")
        assert out.state in (LeaseState.ABORTED, LeaseState.EXPIRED) and out.reason
        assert waited <= TTL + SLACK
        if fault == "SIGKILL":  # a dead peer's closed connection is noticed at once, not at the deadline
            assert out.state == LeaseState.ABORTED and waited < TTL, out
        assert receiver.abort(lease.lease_id) is False  # it has ended: no late write can land now
        dst.end(receiver, lease)
        with dst.lock:
            dst.pool.release(filler)
        dst.assert_all_back()
        local_transfer_to(receiver, dst, transport)  # the survivor goes on
    finally:
        if peer:
            if fault == "SIGSTOP":
                os.kill(peer.proc.pid, signal.SIGCONT)
            peer.kill()
        receiver.close()
    dst.assert_all_back()


class SlowSource:
    """Source that takes 0.3 s per chunk after the first, so the receiver can be killed mid-transfer."""

    def __init__(self, kv: torch.Tensor):
        self.inner = PagedKV(kv)
        self.layout, self.device = self.inner.layout, self.inner.device
        self.gathers = 0
        self.first_sent = threading.Event()

    def gather(self, block_ids, out=None):
        self.gathers += 1
        if self.gathers > 1:
            self.first_sent.set()
            time.sleep(0.3)
        return self.inner.gather(block_ids, out)


@pytest.mark.parametrize("transport", ["gloo", "grpc"])
def test_receiver_killed_mid_transfer(transport):
    src = Pool(make_kv(5))
    source = SlowSource(src.kv)
    sender = KVSender(source, pool_release(src.pool, src.lock), peer_config(transport, TTL))
    peer = Peer("receiver", "--transport", transport, "--blocks", "16", "--ttl", str(TTL))
    try:
        lease = lease_from_line(peer.expect("lease")["lease"])
        with src.lock:
            ids = src.pool.allocate(16)
        killer = threading.Thread(target=lambda: source.first_sent.wait(10) and peer.kill())
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(KVTransferError) as info:
            sender.send(lease, ids)
        waited = time.monotonic() - t0
        killer.join()
        print(f"{transport} receiver killed: sender raised after {waited:.2f}s: {info.value!r}")
        assert source.first_sent.is_set(), "the receiver must die mid-transfer"
        assert waited <= TTL + SLACK, f"sender took {waited:.1f}s to notice"
        assert str(info.value)
        src.assert_all_back()
        # the survivor goes on: send to a fresh receiver in this process
        dst = Pool(make_kv(None))
        with KVReceiver(PagedKV(dst.kv), peer_config(transport, TTL)).start() as receiver:
            lease2 = dst.open_lease(receiver, "after", 3)
            with src.lock:
                ids2 = src.pool.allocate(3)
            source.gathers = -100  # no more slowness
            sender.send(lease2, ids2)
            assert torch.equal(dst.kv[:, :, list(lease2.block_ids)], src.kv[:, :, ids2])
            dst.end(receiver, lease2)
        src.assert_all_back()
        dst.assert_all_back()
    finally:
        peer.kill()
        sender.close()
