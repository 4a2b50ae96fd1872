"""The composition root: ``build_app(config)``, the Serve application graph. The only module that imports
``router/`` and the pool workers together.

    client --HTTP--> DecodeServer (decode pool; serves HTTP itself: OpenAIServer + DecodeWorker)
                          --handle--> PrefillServer (prefill pool; absent when colocated)
             PoolBoard: the latest ReplicaStats of every replica (health, /metrics, /admin/pools); in the
                        decode replica's process when that replica is the only one

The replica that owns a request's stream serves its HTTP: the edge (``router.server``) runs in the
decode replica's process next to the engine, so tokens reach the client with no hop between
processes. With Serve's direct ingress (``shapeserve serve`` turns it on for one decode replica)
clients connect to that replica's port; otherwise Serve's proxy forwards to the decode pool and
its request router (``DecodeRequestRouter``) picks the replica.

Each pool is a deployment placed by ``cluster.serving.placement`` (CPUs, GPUs, threads; custom
``resources`` such as ``{"prefill": 1}`` land it on that node type), with its Serve request
router, its autoscaling policy when configured, and a graceful shutdown that drains running
requests before a replica goes. Peers are passed through ``.bind()`` handles only.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import TYPE_CHECKING, Any

from ray import serve
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from cluster.engine.host_memory import ARENA_ENV
from cluster.serving.autoscaling import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT, replica_env, serve_autoscaling_config
from cluster.serving.config import PoolConfig, ServeConfig
from cluster.serving.messages import PrefillResult, PrefillTask
from cluster.serving.placement import Placement, PoolPlacement, describe, place_pools
from cluster.serving.pool_board import InProcessBoard, PoolBoard, board_stale_after_s
from router.replica_choice import DecodeRequestRouter, PrefillRequestRouter
from router.request_ids import SERVE_HTTP_CALLBACK as SERVE_HTTP_CALLBACK  # the CLI's, which may not import router

if TYPE_CHECKING:
    from decode_workers.replica import DecodeWorker
    from prefill_workers.replica import PrefillWorker
    from router.server import OpenAIServer

log = logging.getLogger(__name__)

#: The pool board is cluster-wide state, like Serve's controller: it lives on the head node with it, so the loss
#: of a worker node never takes the board (and every replica's last report) along. Ray gives the head node this
#: resource; the board takes no CPU.
BOARD_ACTOR_OPTIONS = {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}}

APP_NAME = "shapeserve"


def replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve  # noqa: BLE001
        return "local"


def node_ip() -> str:
    """The address peers reach this node at; raises (no silent 127.0.0.1) when Ray cannot tell."""
    import ray

    try:
        return ray.util.get_node_ip_address()
    except Exception as e:
        raise RuntimeError(
            f"cannot find this node's IP address for the KV receiver ({e!r}); set kv_transfer_host in the config"
        ) from e


class PrefillServer:
    """The prefill pool's deployment: a ``PrefillWorker`` and Serve's hooks."""

    async def __init__(self, config: ServeConfig, model_dir: str, board, num_threads: int):  # type: ignore[misc]
        # Imported here, in the replica: the driver that builds the app never loads torch or the model code.
        from cluster.serving import tracing
        from prefill_workers.replica import PrefillWorker

        tracing.configure(config.tracing, "prefill")
        self.worker: PrefillWorker = await PrefillWorker.start(config, model_dir, board, replica_id(), num_threads)

    async def prefill(self, task: PrefillTask) -> PrefillResult:
        return await self.worker.prefill(task)

    def record_routing_stats(self) -> dict[str, Any]:
        return self.worker.routing_stats().as_dict()

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.worker.autoscaling_stats()

    def check_health(self) -> None:
        self.worker.check_health()

    def __del__(self):
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.shutdown()


@serve.ingress()
class DecodeServer:
    """The decode pool's deployment: a ``DecodeWorker`` and the HTTP edge in front of it, one process."""

    async def __init__(self, config: ServeConfig, model_dir: str, prefill, board, num_threads: int):  # type: ignore[misc]
        # Imported here, in the replica: the driver that builds the app never loads torch or the model code.
        from cluster.serving import tracing
        from cluster.serving.direct_ingress import allow_rebind_after_crash
        from decode_workers.replica import DecodeWorker
        from router.server import OpenAIServer

        tracing.configure(config.tracing, "decode")
        allow_rebind_after_crash()  # before Serve starts this replica's HTTP server (after __init__)

        if isinstance(board, PoolBoard):  # the board of a lone replica, passed by value (``board_in_process``)
            board = InProcessBoard(board)
        kv_host = node_ip() if prefill is not None and config.kv_transfer_host is None else None
        self.worker: DecodeWorker = await DecodeWorker.start(
            config, model_dir, prefill, board, replica_id(), num_threads, kv_host
        )
        # The edge tokenizes on the event loop (and a thread pool) while the engine thread detokenizes: each
        # gets its own copy of the tokenizer (a copy costs a fraction of loading it again).
        tokenizer = copy.deepcopy(self.worker.engine.engine.tokenizer)
        self.edge: OpenAIServer = OpenAIServer(
            config,
            model_dir,
            self.worker,
            board,
            disaggregated=prefill is not None,
            tokenizer=tokenizer,
            metrics_scope="cluster",  # any decode replica's /metrics is the cluster's (Ray's metrics pipeline)
        )

    def __serve_build_asgi_app__(self):
        return self.edge.asgi_app()

    def record_routing_stats(self) -> dict[str, Any]:
        return self.worker.routing_stats().as_dict()

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.worker.autoscaling_stats()

    def check_health(self) -> None:
        self.worker.check_health()

    def __del__(self):
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.shutdown()


def cluster_resources() -> tuple[float, float]:
    """(CPUs, GPUs) of the connected Ray cluster; of this host when Ray is not initialized (building only)."""

    import ray

    if ray.is_initialized():
        res = ray.cluster_resources()
        return float(res.get("CPU", 1)), float(res.get("GPU", 0))
    import torch

    return float(os.cpu_count() or 1), float(torch.cuda.device_count())


#: Requests Serve's proxy holds for the decode pool while none of its replicas can take one (beyond: 503).
DECODE_MAX_QUEUED_REQUESTS = 64


def queued_limit(name: str, pool: PoolConfig) -> int:
    """Serve's ``max_queued_requests`` for a pool (-1: unbounded).

    Unbounded under Serve's direct ingress (``shapeserve serve`` with one decode replica; the variable Serve itself
    reads): the replica serves the port and there is no proxy to hold requests, and the replica's own count of
    queued requests includes a burst's requests not yet picked up by its event loop: a limit there refused the
    burst of a load test (42 of 64 requests, ``bench/compare_vllm.sh``)."""
    if os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1":
        return -1
    if pool.max_queued_requests is not None:
        return pool.max_queued_requests
    return DECODE_MAX_QUEUED_REQUESTS if name == DECODE_DEPLOYMENT else -1


def _pool_options(
    name: str, pool: PoolConfig, placed: PoolPlacement, config: ServeConfig, router_cls: type
) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": placed.num_cpus, "num_gpus": placed.num_gpus}
    if placed.num_gpus == 0 and any(os.environ.get(k) != v for k, v in ARENA_ENV.items()):
        # The engine runs on a thread of a process Ray has already filled with threads: one malloc arena
        # from the start, or its activations are mmapped afresh every step (cluster.engine.host_memory).
        # (``shapeserve serve`` sets it for the whole local cluster instead: a runtime_env costs a worker
        # start of its own.)
        actor["runtime_env"] = {"env_vars": dict(ARENA_ENV)}
    if pool.autoscaling is not None:
        env = replica_env(pool.autoscaling, config.pool_ratio)
        actor.setdefault("runtime_env", {}).setdefault("env_vars", {}).update(env)
    if pool.resources:
        actor["resources"] = dict(pool.resources)
    opts: dict[str, Any] = {
        "name": name,
        "ray_actor_options": actor,
        "max_ongoing_requests": pool.max_ongoing_requests,
        # While no replica can take a request (a crash, a restart), Serve's proxy holds a few and answers the rest
        # 503 + Retry-After at once, instead of holding every request until a replica is back.
        "max_queued_requests": queued_limit(name, pool),
        "backpressure_config": BackpressureConfig(status_code=503, retry_after_s=pool.unavailable_retry_after_s),
        "request_router_config": RequestRouterConfig(
            request_router_class=router_cls,  # type: ignore[arg-type]  # Serve accepts the class or its import path
            request_router_kwargs={"block_size": config.block_tokens},
            request_routing_stats_period_s=config.routing_stats_period_s,  # type: ignore[arg-type]
            request_routing_stats_timeout_s=max(1.0, 4 * config.routing_stats_period_s),  # type: ignore[arg-type]
        ),
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 10.0,
        # Scale-down drains: the replica stops receiving requests and gets this long to finish them.
        "graceful_shutdown_wait_loop_s": 1.0,
        "graceful_shutdown_timeout_s": config.timeouts.request_timeout_s,
    }
    if pool.autoscaling is not None:
        opts["autoscaling_config"] = serve_autoscaling_config(
            "prefill" if name == PREFILL_DEPLOYMENT else "decode", pool.autoscaling, config.pool_ratio
        )
    else:
        opts["num_replicas"] = pool.num_replicas
    return opts


def build_app(
    config: ServeConfig, model_dir: str | None = None, placement: Placement | None = None
) -> serve.Application:
    """The whole Serve graph for ``config``; ``model_dir`` overrides ``config.model`` (the demo model is built
    into the cache dir when neither is given); ``placement`` defaults to ``place_pools`` on the cluster's
    resources and is logged."""
    if model_dir is None:
        model_dir = config.model
    if model_dir is None:
        from cluster.tools.demo_model import ensure_demo_model

        model_dir = str(ensure_demo_model())
    if placement is None:
        placement = place_pools(config, *cluster_resources())
    log.info(describe(placement))
    stale_after_s = board_stale_after_s(config.routing_stats_period_s)
    board: Any
    if board_in_process(config, placement):
        # One replica reports: it holds the board itself (a copy of this object is passed to its constructor).
        board = PoolBoard(stale_after_s)
    else:
        board = serve.deployment(
            name="PoolBoard", num_replicas=1, ray_actor_options=BOARD_ACTOR_OPTIONS, max_ongoing_requests=1000
        )(PoolBoard).bind(stale_after_s=stale_after_s)
    prefill = None
    if placement.prefill is not None:
        options = _pool_options(PREFILL_DEPLOYMENT, config.prefill, placement.prefill, config, PrefillRequestRouter)
        prefill = serve.deployment(**options)(PrefillServer).bind(
            config, model_dir, board, placement.prefill.num_threads
        )
    options = _pool_options(DECODE_DEPLOYMENT, config.decode, placement.decode, config, DecodeRequestRouter)
    return serve.deployment(**options)(DecodeServer).bind(
        config, model_dir, prefill, board, placement.decode.num_threads
    )


def board_in_process(config: ServeConfig, placement: Placement) -> bool:
    """Whether the pool board lives in the decode replica: when that replica is the only one there will ever be
    (no prefill pool, one decode replica, no autoscaling), so no other process reports to it or reads it."""
    return placement.prefill is None and config.decode.num_replicas == 1 and config.decode.autoscaling is None


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Serve's application-builder entry point (``import_path: cluster.app:app_builder`` in a Serve
    config YAML). ``args``: ``config`` (path of a ServeConfig YAML; the defaults without it) and/or
    ``overrides`` (a mapping of top-level ServeConfig fields), e.g. ``model``. Anything else is an error:
    ``shapeserve validate`` checks the same rules before a deploy."""
    from cluster.serving.config import serve_config_from_app_args

    return build_app(serve_config_from_app_args(args))
