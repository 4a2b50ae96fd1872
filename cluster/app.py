"""``build_app(config)``: the Serve application graph.

    Router (FastAPI ingress)  --handle-->  DecodeWorker pool  --handle-->  PrefillWorker pool
            \\______________________ PoolBoard (latest ReplicaStats) ____________/

Each pool is a deployment placed by Ray resources (``resources`` such as ``{"prefill": 1}``
land it on that node type; ``num_gpus`` on GPUs), with its Serve request router (replica
choice), its autoscaling policy when configured, and a graceful shutdown that drains running
requests before a replica goes. Peers are passed through ``.bind()`` handles only.
"""

from __future__ import annotations

import time
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from cluster.serving.autoscaling import serve_autoscaling_config
from cluster.serving.metrics import ReplicaStats
from cluster.serving.config import PoolConfig, ServeConfig

APP_NAME = "shapeserve"


class PoolBoard:
    """The latest ``ReplicaStats`` of every pool replica (for /health, /metrics, /admin/pools).

    Reports older than ``stale_after_s`` are dropped: a dead replica disappears on its own.
    """

    def __init__(self, stale_after_s: float):
        self.stale_after_s = stale_after_s
        self._latest: dict[tuple[str, str], ReplicaStats] = {}

    def report(self, stats: ReplicaStats) -> None:
        self._latest[(stats.pool, stats.replica_id)] = stats

    def snapshot(self) -> list[ReplicaStats]:
        cutoff = time.time() - self.stale_after_s
        self._latest = {k: s for k, s in self._latest.items() if s.reported_at >= cutoff}
        return sorted(self._latest.values(), key=lambda s: (s.pool, s.replica_id))


def cluster_has_gpus() -> bool:
    """Whether pools default to one GPU per replica: the Ray cluster's GPUs if connected, else this host's."""
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()


def _pool_options(name: str, pool: PoolConfig, config: ServeConfig, router_cls: type) -> dict[str, Any]:
    num_gpus = pool.num_gpus if pool.num_gpus is not None else (1.0 if cluster_has_gpus() else 0.0)
    actor: dict[str, Any] = {"num_cpus": pool.num_cpus, "num_gpus": num_gpus}
    if pool.resources:
        actor["resources"] = dict(pool.resources)
    opts: dict[str, Any] = {
        "name": name,
        "ray_actor_options": actor,
        "max_ongoing_requests": pool.max_ongoing_requests,
        "request_router_config": RequestRouterConfig(
            request_router_class=router_cls,
            request_router_kwargs={"block_size": config.block_size},
            request_routing_stats_period_s=config.routing_stats_period_s,
            request_routing_stats_timeout_s=max(1.0, 4 * config.routing_stats_period_s),
        ),
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 10.0,
        # Scale-down drains: the replica stops receiving requests and gets this long to finish them.
        "graceful_shutdown_wait_loop_s": 1.0,
        "graceful_shutdown_timeout_s": config.timeouts.request_timeout_s,
    }
    if pool.autoscaling is not None:
        opts["autoscaling_config"] = serve_autoscaling_config(
            "prefill" if "Prefill" in name else "decode", pool.autoscaling
        )
    else:
        opts["num_replicas"] = pool.num_replicas
    return opts


def build_app(config: ServeConfig, model_dir: str | None = None) -> serve.Application:
    """The whole Serve graph for ``config``; ``model_dir`` overrides ``config.model`` (the demo model
    is built into the cache dir when neither is given)."""
    from decode_workers.replica import DecodeWorker
    from prefill_workers.replica import PrefillWorker
    from router.app import Router
    from router.replica_choice import DecodeRequestRouter, PrefillRequestRouter

    if model_dir is None:
        model_dir = config.model
    if model_dir is None:
        from cluster.tools.demo_model import ensure_demo_model

        model_dir = str(ensure_demo_model())
    board = (
        serve.deployment(PoolBoard)
        .options(name="PoolBoard", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
        .bind(stale_after_s=max(3.0, 6 * config.routing_stats_period_s))
    )
    prefill = (
        serve.deployment(PrefillWorker)
        .options(**_pool_options("PrefillWorker", config.prefill, config, PrefillRequestRouter))
        .bind(config, model_dir, board)
    )
    decode = (
        serve.deployment(DecodeWorker)
        .options(**_pool_options("DecodeWorker", config.decode, config, DecodeRequestRouter))
        .bind(config, model_dir, prefill, board)
    )
    return (
        serve.deployment(Router)
        .options(
            name="Router",
            num_replicas=config.router_replicas,
            ray_actor_options={"num_cpus": 0},
            max_ongoing_requests=10000,
        )
        .bind(config, model_dir, decode, board)
    )


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Serve's application-builder entry point (``import_path: cluster.app:app_builder`` in a Serve
    config YAML). ``args``: ``config`` (path of a ServeConfig YAML) and/or ``overrides`` (a mapping of
    top-level ServeConfig fields), e.g. ``model``."""
    from cluster.serving.config import load_serve_config

    config = load_serve_config(args.get("config"))
    overrides = args.get("overrides") or {}
    if overrides:
        config = config.with_overrides(**overrides)
    return build_app(config)
