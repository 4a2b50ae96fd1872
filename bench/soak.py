"""A soak run: mixed traffic with cancellations, hostile requests and a replica kill, for minutes, against
``shapeserve serve`` with a prefill pool (disaggregation on) on the demo model.

    python -m bench.soak [--minutes 3] [--clients 6] [--kill prefill|decode|none]

Each client loops over: a normal request (completions or chat, streamed or not, short prompts that prefill
locally and long ones that go to the prefill pool), a stream it cancels after a few events, and a hostile body
drawn from ``bench.fuzz_http``'s strategies. Halfway through, one replica of ``--kill`` is SIGKILLed (Serve
restarts it). At the end, once the server is idle: KV blocks still in use on any replica (leaks) and each
server process group's memory (PSS) against its value after the warm-up. Prints the counts by outcome.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import httpx

from bench.fuzz_http import request_bodies
from bench.server_process import ServerProcess, machine_line

CONFIG = """shapeserve:
  device: cpu
  served_model_name: demo
  disaggregation: 'on'
  classifier: {local_max_uncached_tokens: 32}
  decode: {num_blocks: 512}
  prefill: {num_blocks: 512}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Soak:
    def __init__(self, url: str, seed: int):
        self.url = url
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # hypothesis warns that .example() is for interactive use
            strategy = request_bodies("demo", 512)
            self.hostile_bodies: list[tuple[str, bytes]] = [strategy.example() for _ in range(200)]

    def prompt(self) -> list[int]:
        n = self.rng.choice([8, 16, 120, 300])  # <= 32 tokens prefill locally, longer ones on the prefill pool
        return [self.rng.randrange(4, 512) for _ in range(n)]

    async def normal(self, client: httpx.AsyncClient) -> None:
        stream = self.rng.random() < 0.5
        body = {"model": "demo", "max_tokens": self.rng.randint(4, 48), "ignore_eos": True, "stream": stream}
        if self.rng.random() < 0.3:
            path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "tell me more"}]}
        else:
            path, body = "/v1/completions", {**body, "prompt": self.prompt()}
        try:
            if not stream:
                r = await client.post(self.url + path, json=body)
                self.counts[_outcome(r.status_code)] += 1
                return
            async with client.stream("POST", self.url + path, json=body) as r:
                if r.status_code != 200:
                    self.counts[_outcome(r.status_code)] += 1
                    return
                last = ""
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        last = line
                error = last != "data: [DONE]"
                self.counts["failed (stream ended without [DONE])" if error else "completed"] += 1
        except httpx.HTTPError:
            self.counts["failed (connection)"] += 1

    async def cancelled(self, client: httpx.AsyncClient) -> None:
        body = {"model": "demo", "prompt": self.prompt(), "max_tokens": 200, "ignore_eos": True, "stream": True}
        try:
            async with client.stream("POST", self.url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    self.counts[_outcome(r.status_code)] += 1
                    return
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data: ")
                    if events >= self.rng.randint(1, 5):
                        break  # closing the response here is the client going away
            self.counts["cancelled by the client"] += 1
        except httpx.HTTPError:
            self.counts["failed (connection)"] += 1

    async def hostile(self, client: httpx.AsyncClient) -> None:
        path, raw = self.rng.choice(self.hostile_bodies)
        try:
            r = await client.post(self.url + path, content=raw, headers={"content-type": "application/json"})
            self.counts["hostile: " + _outcome(r.status_code)] += 1
        except httpx.HTTPError:
            self.counts["hostile: failed (connection)"] += 1

    async def client(self, until: float) -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            while time.monotonic() < until:
                kind = self.rng.random()
                if kind < 0.6:
                    await self.normal(client)
                elif kind < 0.8:
                    await self.cancelled(client)
                else:
                    await self.hostile(client)


def _outcome(status: int) -> str:
    if status == 200:
        return "completed"
    if status == 429:
        return "rejected (429)"
    if status >= 500:
        return f"failed ({status})"
    return f"refused ({status})"


def admin(url: str, wait_s: float = 120.0) -> list[dict]:
    """Every replica's report; waits (up to ``wait_s``) while the endpoint is down (a killed decode replica
    serving the port itself, until Serve has restarted it)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return httpx.get(f"{url}/admin/pools", timeout=10).json()["replicas"]
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--kill", choices=["prefill", "decode", "none"], default="prefill")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(machine_line())
    tmp = Path(tempfile.mkdtemp(prefix="shapeserve-soak-"))
    (tmp / "serve.yaml").write_text(CONFIG)
    port = free_port()
    cmd = [sys.executable, "-m", "cluster.tools.cli", "serve", "--port", str(port), "--config", str(tmp / "serve.yaml")]
    server = ServerProcess(cmd, f"http://127.0.0.1:{port}", str(tmp / "server.log"), env={"RAY_AUTH_MODE": "disabled"})
    server.start(timeout_s=300)
    url = server.url
    try:
        soak = Soak(url, args.seed)
        asyncio.run(soak.client(time.monotonic() + 10))  # warm-up: every path has run once
        pss_before = server.pss_mb()
        soak.counts.clear()
        seconds = args.minutes * 60
        until = time.monotonic() + seconds

        clients = [Soak(url, args.seed + i + 1) for i in range(args.clients)]

        # The decode replica's PSS every 30 s: a plateau is the allocator keeping its high-water mark (by design,
        # cluster/engine/host_memory.py), steady growth would be a leak.
        decode_pss: list[float] = []

        async def sample_memory() -> None:
            while time.monotonic() < until:
                pss = await asyncio.to_thread(server.pss_mb)
                decode_pss.append(pss.get("decode replica (edge + engine)", 0.0))
                await asyncio.sleep(30)

        async def run_clients() -> None:
            tasks = [asyncio.create_task(c.client(until)) for c in clients]
            tasks.append(asyncio.create_task(sample_memory()))
            if args.kill != "none":
                await asyncio.sleep(seconds / 2)
                victim = next(r for r in admin(url) if r["pool"] == args.kill)
                os.kill(victim["pid"], signal.SIGKILL)
                print(f"killed the {args.kill} replica (pid {victim['pid']}) at {seconds / 2:.0f} s", flush=True)
            await asyncio.gather(*tasks)

        asyncio.run(run_clients())
        for c in clients:
            soak.counts.update(c.counts)
        # Idle: every replica reports no block in use and no live request (after a kill, the new replica too).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            reps = admin(url)
            if reps and all(r["kv_blocks_used"] == 0 and r["active_requests"] == 0 for r in reps):
                break
            time.sleep(1)
        reps = admin(url)
        leaked = sum(r["kv_blocks_used"] for r in reps)
        pss_after = server.pss_mb()
    finally:
        server.stop()
    total = sum(soak.counts.values())
    print(f"\n{total} requests in {args.minutes:g} min from {args.clients} clients, kill: {args.kill}")
    for outcome, n in sorted(soak.counts.items()):
        print(f"  {outcome:45} {n:6d}")
    print(f"KV blocks in use once idle (leaks): {leaked} on {len(reps)} replicas")
    print("memory (PSS, MB) after warm-up -> end:")
    for group in sorted(pss_before):
        before, after = pss_before[group], pss_after.get(group, 0.0)
        print(f"  {group:45} {before:8.0f} -> {after:8.0f} ({after - before:+.0f})")
    print("decode replica PSS every 30 s, MB: " + " ".join(f"{v:.0f}" for v in decode_pss))
    print(json.dumps({"counts": dict(soak.counts), "leaked_blocks": leaked}))
    return 0 if leaked == 0 and not any(k.startswith("failed (5") for k in soak.counts) else 1


if __name__ == "__main__":
    sys.exit(main())
