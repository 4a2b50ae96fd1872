"""The decode pool scales on a real multi-node local Ray cluster: a load ramp takes it from 1 replica to 2, the
end of the load back to 1, and every request of the run completes (the replica that left drained first)."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

MAX_TOKENS = 48


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decode_replicas(app: str) -> int:
    from ray import serve

    status = serve.status().applications[app].deployments["DecodeWorker"]
    return status.replica_states.get("RUNNING", 0)


async def one_request(client: httpx.AsyncClient, url: str, i: int) -> int:
    body = {"model": "demo", "prompt": [4 + (i * 37 + k) % 400 for k in range(8)], "max_tokens": MAX_TOKENS}
    r = await client.post(f"{url}/v1/completions", json={**body, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["completion_tokens"]


async def load(url: str, concurrency: int, until, results: list[int]) -> None:
    """``concurrency`` clients each sending requests back to back until ``until()`` is true."""
    async with httpx.AsyncClient(timeout=120) as client:

        async def worker(w: int) -> None:
            n = 0
            while not until():
                results.append(await one_request(client, url, w * 1000 + n))
                n += 1

        await asyncio.gather(*(worker(w) for w in range(concurrency)))


def test_decode_pool_scales_up_under_load_and_drains_down(demo_model):
    auth_mode = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from cluster.app import APP_NAME, build_app
    from cluster.serving.config import parse_serve_config

    port = _free_port()
    config = parse_serve_config(
        {
            "device": "cpu",
            "host": "127.0.0.1",
            "port": port,
            "served_model_name": "demo",
            "disaggregation": "off",
            "decode": {
                "num_cpus": 0,
                "num_threads": 1,
                "num_blocks": 256,
                "resources": {"decode": 1},
                "autoscaling": {
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "target_running_seqs_per_replica": 2,
                    "spike_window_s": 2,
                    "trend_window_s": 2,
                    "upscale_delay_s": 0.5,
                    "downscale_delay_s": 2,
                    "metrics_push_interval_s": 0.5,
                },
            },
            "timeouts": {"request_timeout_s": 60},
        }
    )
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"decode": 1})
    cluster.add_node(num_cpus=1, resources={"decode": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config, str(demo_model)), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        assert decode_replicas(APP_NAME) == 1
        results: list[int] = []
        t0 = time.monotonic()
        # The ramp: 6 clients, 3x a replica's target of running sequences, until the second replica serves.
        asyncio.run(load(url, 6, lambda: decode_replicas(APP_NAME) == 2 or time.monotonic() - t0 > 120, results))
        assert decode_replicas(APP_NAME) == 2, "the decode pool did not scale up under load"
        up_s = time.monotonic() - t0
        # The drop: one client keeps sending while the pool shrinks; requests on the replica that leaves finish.
        t1 = time.monotonic()
        asyncio.run(load(url, 1, lambda: decode_replicas(APP_NAME) == 1 or time.monotonic() - t1 > 120, results))
        assert decode_replicas(APP_NAME) == 1, "the decode pool did not scale back down"
        # And the pool still serves afterwards.
        n_before = len(results)
        asyncio.run(load(url, 2, lambda: len(results) >= n_before + 4, results))
        assert results and all(n == MAX_TOKENS for n in results)  # every request of the run completed in full
        print(f"scaled up after {up_s:.1f} s, down after {time.monotonic() - t1:.1f} s; {len(results)} requests")
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        if auth_mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = auth_mode
