"""KV transfer throughput per transport, as a ratio to a plain in-process copy of the same bytes.

    .venv/bin/python -m bench.kv_transfer [--sizes-mb 64 256] [--transports gloo grpc] [--repeats 3]

The receiver runs in this process, the sender in a child process (this file, ``--role sender``);
both hold a paged KV pool of the bench layout and move whole blocks between different block ids.
The receiving side reserves blocks in its own pool and leases them (``KVReceiver.open_lease``);
the lease reaches the sender as one JSON line on its stdin.
A transfer is timed on the sender from ``KVSender.send`` to the completion ack (handshake and
group setup are done by a warm-up transfer first). Prints a table; nccl runs only with 2 GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # first: this file's own name must not shadow the kv_transfer package

import torch  # noqa: E402

from cluster.engine.block_pool import BlockPool  # noqa: E402
from cluster.engine.kv_cache import allocate_kv_cache  # noqa: E402
from cluster.kv_layout import KVLayout  # noqa: E402
from kv_transfer import KVReceiver, KVSender, KVTransferConfig, Lease, PagedKV, Release  # noqa: E402

#: An 8-layer, 8 KV-head, head_dim 128, fp16 model with 16-token blocks: 512 KiB per block.
LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 8, 8, 128, 16, "float16"


def bench_layout(num_blocks: int) -> KVLayout:
    return KVLayout(LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE, num_blocks)


def pool_release(pool: BlockPool, lock: threading.Lock) -> Release:
    def release(request_id: str, block_ids: Sequence[int]) -> None:
        with lock:
            pool.release(block_ids)

    return release


def lease_to_line(lease: Lease) -> str:
    return json.dumps(dataclasses.asdict(lease))


def lease_from_line(line: str) -> Lease:
    fields = json.loads(line)
    return Lease(**{**fields, "block_ids": tuple(fields["block_ids"])})


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def time_copy(mb: int, repeats: int) -> float:
    src = torch.randn((mb << 20) // 2, dtype=torch.float32).to(torch.float16)
    dst = torch.empty_like(src)
    return best_of(lambda: dst.copy_(src), repeats)


def time_gather_scatter(n: int, repeats: int) -> float:
    a = PagedKV(allocate_kv_cache(bench_layout(n + 8), "cpu"))
    b = PagedKV(allocate_kv_cache(bench_layout(n + 8), "cpu"))
    ids, buf = list(range(n)), torch.empty(a.kv[:, :, :n].shape, dtype=a.kv.dtype)
    return best_of(lambda: b.scatter(ids[::-1], a.gather(ids, buf)), repeats)


# ---- child: the sender --------------------------------------------------------------------


def run_sender(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    device = "cuda:1" if args.transport == "nccl" else "cpu"
    layout = bench_layout(args.num_blocks)
    kv = allocate_kv_cache(layout, device)
    kv.copy_(torch.randn(kv.shape, dtype=torch.float32).to(kv.dtype))  # not zeros: no compressible shortcuts
    pool, lock = BlockPool(layout.num_blocks), threading.Lock()
    sender = KVSender(
        PagedKV(kv), pool_release(pool, lock), KVTransferConfig(transport=args.transport, lease_ttl_s=600)
    )
    print(json.dumps({"event": "started"}), flush=True)
    for line in sys.stdin:
        lease = lease_from_line(line)
        with lock:
            allocated = pool.allocate(lease.num_blocks)
        assert allocated is not None, "the sender's pool is sized for the largest transfer"
        src = allocated[::-1]
        res = sender.send(lease, src)
        print(
            json.dumps({"event": "sent", "seconds": res.seconds, "nbytes": res.nbytes, "transport": res.transport}),
            flush=True,
        )
    sender.close()


# ---- parent: the receiver + the table ------------------------------------------------------


class SenderProcess:
    def __init__(self, transport: str, num_blocks: int, threads: int):
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.kv_transfer",
                "--role",
                "sender",
                "--transport",
                transport,
                "--num-blocks",
                str(num_blocks),
                "--threads",
                str(threads),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(ROOT),
        )
        self.read("started")

    def read(self, name: str) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                ev = json.loads(line)
                if ev["event"] == name:
                    return ev
        raise RuntimeError(f"sender exited before {name!r} (rc={self.proc.wait()})")

    def transfer(self, receiver: KVReceiver, pool: BlockPool, num_blocks: int) -> dict:
        blocks = pool.allocate(num_blocks)
        assert blocks is not None
        lease = receiver.open_lease("bench", blocks, ttl_s=600)
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(lease_to_line(lease) + "\n")
            self.proc.stdin.flush()
            ev = self.read("sent")
            assert receiver.wait(lease.lease_id, 60).ok
        finally:
            receiver.abort(lease.lease_id)  # a no-op once completed; then the blocks are ours again
            pool.release(blocks)
        return ev

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", default="receiver", choices=("receiver", "sender"))
    p.add_argument("--transport", default="grpc")
    p.add_argument("--transports", nargs="+", default=["gloo", "grpc", "nccl"])
    p.add_argument("--sizes-mb", nargs="+", type=int, default=[64, 256])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--num-blocks", type=int, default=0)
    args = p.parse_args()
    if args.role == "sender":
        return run_sender(args)

    torch.set_num_threads(args.threads)
    block_bytes = bench_layout(1).bytes_per_block
    sizes = {mb: (mb << 20) // block_bytes for mb in args.sizes_mb}
    num_blocks = max(sizes.values()) + 8
    print(
        f"# KV transfer bench: layout L={LAYERS} H={HEADS} D={HEAD_DIM} block_size={BLOCK_SIZE} {DTYPE} "
        f"({block_bytes >> 10} KiB/block), best of {args.repeats}, torch threads/process={args.threads}"
    )
    print(f"# host: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}")

    # Baseline: a plain in-process copy of the same bytes (and a gather+scatter of the same blocks).
    base = {mb: time_copy(mb, args.repeats) for mb in sizes}
    gs = {mb: time_gather_scatter(n, args.repeats) for mb, n in sizes.items()}

    rows: list[tuple[int, str, float | None, str]] = []
    for mb in sizes:
        rows.append((mb, "copy (in-process)", base[mb], ""))
        rows.append((mb, "gather+scatter (in-process)", gs[mb], ""))
    for transport in args.transports:
        if transport == "nccl" and torch.cuda.device_count() < 2:
            rows.append((0, "nccl", None, "not run: needs 2 CUDA devices (none here)"))
            continue
        device = "cuda:0" if transport == "nccl" else "cpu"
        dst_layout = bench_layout(num_blocks)
        pool = BlockPool(num_blocks)
        receiver = KVReceiver(
            PagedKV(allocate_kv_cache(dst_layout, device)),
            KVTransferConfig(transport=transport, lease_ttl_s=600),
        ).start()
        sender = SenderProcess(transport, num_blocks, args.threads)
        try:
            sender.transfer(receiver, pool, 2)  # warm-up: handshake, group setup
            for mb, n in sizes.items():
                secs = min(sender.transfer(receiver, pool, n)["seconds"] for _ in range(args.repeats))
                rows.append((mb, transport, secs, ""))
        finally:
            sender.close()
            receiver.close()

    print("\n| size | path | seconds | GB/s | vs in-process copy |")
    print("|---:|---|---:|---:|---:|")
    for mb, name, secs, note in rows:
        if secs is None:
            print(f"| - | {name} | - | - | {note} |")
            continue
        gbps = (mb << 20) / secs / 1e9
        print(f"| {mb} MB | {name} | {secs:.4f} | {gbps:.2f} | {base[mb] / secs:.3f} |")


if __name__ == "__main__":
    main()
