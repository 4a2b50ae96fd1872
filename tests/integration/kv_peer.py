"""One side of a KV transfer in its own process, driven by the multi-process tests and the bench.

    python tests/integration/kv_peer.py sender   --transport gloo --seed 3 [--stall-after N]   (lease JSON on stdin)
    python tests/integration/kv_peer.py receiver --transport grpc --blocks 16 --ttl 2

It prints one JSON object per line on stdout (``{"event": ...}``); the parent reads them with
``Peer.expect``. Sender KV is ``make_kv(seed)``, so the parent can rebuild it and compare bits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from cluster.engine.block_pool import BlockPool  # noqa: E402
from kv_transfer import (  # noqa: E402
    KVReceiver,
    KVSender,
    KVTransferConfig,
    KVTransferError,
    Lease,
    PagedKV,
    Release,
)

#: [layers, 2, num_blocks, block_size, kv_heads, head_dim]: 1 KiB per float32 block.
LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 48, 4, 2, 8


def make_kv(seed: int | None, dtype: str = "float32", num_blocks: int = NUM_BLOCKS, shape=None) -> torch.Tensor:
    shape = shape or (LAYERS, 2, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM)
    dt = getattr(torch, dtype)
    if seed is None:
        return torch.zeros(shape, dtype=dt)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dt)


def peer_config(transport: str, ttl: float) -> KVTransferConfig:
    return KVTransferConfig(
        transport=transport,
        lease_ttl_s=ttl,
        rpc_timeout_s=ttl,
        connect_timeout_s=5.0,
        collective_timeout_s=ttl,
        grpc_chunk_bytes=2048,
        collective_chunk_bytes=4096,
        reaper_interval_s=0.05,
    )


def pool_release(pool: BlockPool, lock: threading.Lock) -> Release:
    """Sender-side release over a bare pool: drops the reference the sender held for the transfer."""

    def release(request_id: str, block_ids: Sequence[int]) -> None:
        with lock:
            pool.release(block_ids)

    return release


def lease_to_line(lease: Lease) -> str:
    """A lease as one JSON line (between processes; the serving layer pickles it through Ray instead)."""
    return json.dumps(dataclasses.asdict(lease))


def lease_from_line(line: str) -> Lease:
    fields = json.loads(line)
    return Lease(**{**fields, "block_ids": tuple(fields["block_ids"])})


def emit(**event) -> None:
    print(json.dumps(event), flush=True)


class StallingSource:
    """Gathers normally ``stall_after`` times, then hangs (a stuck prefill worker, frozen in place)."""

    def __init__(self, inner: PagedKV, stall_after: int):
        self.inner, self.stall_after, self.calls = inner, stall_after, 0
        self.layout, self.device = inner.layout, inner.device

    def gather(self, block_ids, out=None):
        self.calls += 1
        if self.calls > self.stall_after:
            emit(event="stalled", gathers=self.calls - 1)
            time.sleep(3600)
        return self.inner.gather(block_ids, out)


def run_sender(args: argparse.Namespace) -> None:
    kv = make_kv(args.seed, args.dtype)
    pool, lock = BlockPool(kv.shape[2]), threading.Lock()
    emit(event="started")  # the parent opens the lease now: its deadline must not cover our start-up
    lease = lease_from_line(sys.stdin.readline())
    src = pool.allocate(lease.num_blocks)[::-1]  # reversed: never the receiver's ids in the same order
    source = PagedKV(kv) if args.stall_after < 0 else StallingSource(PagedKV(kv), args.stall_after)
    sender = KVSender(source, pool_release(pool, lock), peer_config(args.transport, args.ttl))
    emit(event="ready", src=src)
    try:
        res = sender.send(lease, src)
        emit(event="sent", transport=res.transport, nbytes=res.nbytes, seconds=res.seconds)
    except KVTransferError as e:
        emit(event="error", error=type(e).__name__, message=str(e))
    pool.check_integrity()
    emit(event="done", free=pool.num_free_blocks, total=pool.num_blocks)
    sender.close()


def run_receiver(args: argparse.Namespace) -> None:
    kv = make_kv(None, args.dtype)
    pool = BlockPool(kv.shape[2])
    receiver = KVReceiver(PagedKV(kv), peer_config(args.transport, args.ttl)).start()
    blocks = pool.allocate(args.blocks)  # this side owns its blocks: reserve, then lease
    lease = receiver.open_lease("req-child", blocks)
    emit(event="lease", lease=lease_to_line(lease))
    out = receiver.wait(lease.lease_id, args.ttl + 30)
    emit(event="outcome", state=out.state.name, reason=out.reason)
    receiver.abort(lease.lease_id)  # a no-op once ended; then the blocks are ours again
    pool.release(blocks)
    receiver.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("sender", "receiver"))
    p.add_argument("--transport", default="grpc")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--ttl", type=float, default=5.0)
    p.add_argument("--stall-after", type=int, default=-1)
    args = p.parse_args()
    torch.set_num_threads(1)
    (run_sender if args.role == "sender" else run_receiver)(args)


# ---- parent side ------------------------------------------------------------------------


class Peer:
    """A child process running this file; ``expect`` reads its JSON events with a deadline."""

    def __init__(self, *argv: str):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(ROOT),
        )
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put({"event": "exit"})

    def send_lease(self, lease) -> None:
        """Hands the lease to a sender peer (after its "started" event)."""
        self.proc.stdin.write(lease_to_line(lease) + "\n")
        self.proc.stdin.flush()

    def expect(self, name: str, timeout: float = 30.0) -> dict:
        end = time.monotonic() + timeout
        while True:
            try:
                ev = self.events.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no {name!r} event from the peer within {timeout}s") from None
            if ev["event"] == name:
                return ev
            if ev["event"] == "exit":
                raise RuntimeError(f"peer exited before {name!r}: {self.proc.stderr.read()[-2000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


if __name__ == "__main__":
    main()
