"""``shapeserve serve``: the serving cluster on its own local Ray (or on a running cluster with ``--address``).

By default: the built-in demo model on CPU, pools placed by ``cluster.serving.placement`` (on a small
node one decode replica prefills and decodes with all the cores). The decode replica serves HTTP on
``--port`` itself (Serve's direct ingress: no proxy hop), when there is one decode replica and Ray is
started here; otherwise Serve's proxy serves the port. Prints the URL once ``/health`` answers 200;
Ctrl-C (or SIGTERM) removes the application (and stops the Ray this command started).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
import time

from cluster.config import ModelConfig
from cluster.engine.host_memory import ARENA_ENV, available_memory_bytes
from cluster.errors import ConfigError, ShapeserveError
from cluster.kv_layout import KVLayout, check_kv_pools_fit, pool_layout
from cluster.tool_calls import TOOL_CALL_PARSERS

#: The local Ray's metrics endpoint, where ``ray start --metrics-export-port`` puts it on a cluster's nodes.
RAY_METRICS_PORT = 8080
#: How often Ray's workers push their metrics to the node's agent: how far /metrics may lag behind the requests
#: (Ray's default is 10 s; each report is work in every Ray worker, so a shorter interval costs more CPU).
RAY_METRICS_REPORT_INTERVAL_MS = 5000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local Hugging Face model directory (default: the demo model)")
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="weights and KV dtype"
    )
    parser.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port to listen on (default 8000)")
    parser.add_argument("--config", default=None, help="ServeConfig YAML (pools, classifier, admission, timeouts)")
    parser.add_argument("--address", default=None, help="deploy on a running Ray cluster instead of starting one")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for both pools")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="name(s) clients pass as 'model' (the first one is used in responses); default: the directory's name",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context length served (default: the model's; at most it)"
    )
    parser.add_argument(
        "--chat-template", default=None, metavar="FILE", help="Jinja chat template instead of the model's"
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help='how tool calls are found in the output for tool_choice "auto" (the format the model was trained on)',
    )
    parser.add_argument(
        "--ray-metrics-port",
        type=int,
        default=RAY_METRICS_PORT,
        help="port of the local Ray's metrics endpoint (Ray's and Serve's series, the source of /metrics's request "
        f"families; default {RAY_METRICS_PORT}, another free one when it is taken)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SHAPESERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize (default: $SHAPESERVE_API_KEY; "
        "the variable keeps the key out of the process list)",
    )


def ray_metrics_urls() -> str:
    from cluster.serving.ray_metrics import alive_node_endpoints

    return ", ".join(f"http://{endpoint}/metrics" for endpoint in alive_node_endpoints())


def _wait_ready(url: str, timeout_s: float) -> bool:
    import httpx

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def direct_ingress_env(port: int) -> dict[str, str]:
    """Serve settings that make the decode replica serve ``port`` itself (one replica, one node)."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # exclusive bound
        # No load balancer in front to drain or to route stale slots: a restarted replica takes the port
        # back at once, and Ctrl-C does not wait out a drain period.
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
        # The HTTP server runs on the replica's event loop: user code on the same loop spares every
        # ASGI message a hop between threads (one of Serve's throughput-optimized settings).
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    }


def unreachable_ray_address(address: str, timeout_s: float = 5.0) -> str | None:
    """Why ``--address`` names no Ray cluster, or None when something listens there (or it is ``auto``). Checked
    before ``ray.init``, which retries an address nothing answers at for minutes, printing gRPC warnings."""
    if address == "auto":
        return None
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return (
            f"--address takes the head node's host:port (e.g. 10.0.0.5:6379), ray://host:port or auto, not {address!r}"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except OSError as e:
        return (
            f"no Ray cluster answers at {host}:{port} ({e.strerror or e}); start one there with `ray start --head`, "
            "or leave out --address and shapeserve starts a local one"
        )


#: What to lower when the pools' KV caches do not fit.
KV_SETTINGS = "decode.kv_cache_memory_gb / prefill.kv_cache_memory_gb (or num_blocks) in the serve config"


def host_kv_pools(config, model_dir: str, placement) -> dict[str, tuple[int, KVLayout]]:
    """The KV pools of the replicas the application starts with (pool -> (replicas, layout)), for one host's check:
    a CPU pool bigger than the memory its host has failed in each replica's start, three times over (Serve retries a
    replica), before the CLI could say why."""
    model = ModelConfig.from_pretrained(model_dir)
    pools = {}
    for name, placed in (("decode", placement.decode), ("prefill", placement.prefill)):
        pool = getattr(config, name)
        if placed is None or placed.num_gpus:  # a GPU pool's cache is in GPU memory
            continue
        replicas = pool.num_replicas if pool.autoscaling is None else pool.autoscaling.min_replicas
        pools[name] = (replicas, pool_layout(model, config.engine_config(name, model_dir, placed.num_threads)))
    return pools


def quiet_serve_env() -> dict[str, str]:
    """Serve settings for a deployment that does not change by itself (one decode replica, no autoscaling in
    either pool).

    Serve's controller reconciles every 0.1 s by default, mostly to notice changes that cannot happen here
    (replicas to add, routes to move); each pass also queries the GCS. Idle, those two were the server's busiest
    processes after the replica, on the cores the engine computes on.
    Every 0.5 s, a crashed replica is noticed up to 0.4 s later; start-up is not slower (it waits on the
    replica's own start)."""
    return {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}


def quiet_ray_env() -> dict[str, str]:
    """Settings for the background processes of the local Ray that ``shapeserve serve`` starts for itself.

    Idle, the server's processes took ~140 ms of CPU per second (``python -m bench.idle_server``), on the cores the
    engine computes on under load; these give back ~23 ms of it, from work that serves nothing here
    (docs/benchmarks.md, "What an idle server costs"):

    - the log monitor streams workers' output to drivers that ask for it (``log_to_driver``), and ours does not; with
      fewer than 1000 log files it rescanned the log directory every 0.1 s, now every 5 s;
    - every core worker sent its task events (``ray list tasks``, the dashboard's task view) to the GCS every second;
      every 5 s they arrive in fewer, larger batches;
    - Ray timed every handler of its internal event loops, for its debug dumps."""
    return {
        "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
        "LOG_NAME_UPDATE_INTERVAL_S": "5",
        "RAY_task_events_report_interval_ms": "5000",
        "RAY_event_stats": "0",
    }


def config_from_args(args: argparse.Namespace):
    """(ServeConfig, model directory) from the flags over the config file; raises ShapeserveError on a bad value or
    model directory (before Ray starts). Builds the demo model when no model is given."""
    from cluster.config import served_context_length
    from cluster.serving.config import load_serve_config
    from cluster.tools.cli import read_chat_template

    config = load_serve_config(args.config).with_overrides(
        model=args.model,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key or None,
        max_model_len=args.max_model_len,
        chat_template=read_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser,
    )
    model_dir = config.model
    if model_dir is None:
        from cluster.tools.demo_model import ensure_demo_model

        model_dir = str(ensure_demo_model())
    # Fail fast, before Ray starts, on a bad directory or a context longer than the model's.
    served_context_length(ModelConfig.from_pretrained(model_dir), config.max_model_len)
    return config, model_dir


#: The pool a deployment of the application serves, for the start-up error.
POOL_OF_DEPLOYMENT = {"DecodeWorker": "decode pool", "PrefillWorker": "prefill pool", "PoolBoard": "pool board"}


def deploy_failures(app_status) -> list[str]:
    """Why each failed deployment of an application (``serve.status().applications[name]``) did not start, one line
    each. Serve keeps the error of the replica's constructor, a traceback, in the deployment's status message; its
    last line names the error (``cluster.errors.ModelLoadError: checkpoint in '...' lacks tensors [...]``), given
    here without the module path."""
    failures = []
    for name, deployment in app_status.deployments.items():
        if getattr(deployment.status, "value", deployment.status) not in ("DEPLOY_FAILED", "UNHEALTHY"):
            continue
        lines = [line.strip() for line in (deployment.message or "").splitlines() if line.strip()]
        cause = lines[-1] if lines else f"its deployment is {getattr(deployment.status, 'value', deployment.status)}"
        kind, sep, text = cause.partition(": ")
        if sep and kind.replace(".", "").replace("_", "").isalnum():  # "module.ErrorType: message"
            cause = f"{kind.rsplit('.', 1)[-1]}: {text}"
        failures.append(f"the {POOL_OF_DEPLOYMENT.get(name, name)}'s replica did not start: {cause}")
    return failures


class StartupInterrupted(BaseException):
    """SIGINT or SIGTERM before the server was ready. A BaseException, like KeyboardInterrupt: raised wherever the
    main thread is, it must not be taken for an error by the ``except Exception`` of the code it interrupts (Ray's
    start-up polls have such handlers, and one swallowed it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """The CLI's SIGINT / SIGTERM handler.

    While the server starts, a signal interrupts the start where it is (Ray's start, the deploy, the wait for the
    replica's model load, which can take minutes), the way Python's own KeyboardInterrupt would: it raises
    ``StartupInterrupted`` in the main thread, once. Once serving, a signal only sets ``stop``: the main loop then
    drains the application."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.interrupt_startup = True

    def __call__(self, signum: int, frame) -> None:
        self.stop.set()
        if self.interrupt_startup:
            self.interrupt_startup = False  # a second signal must not cut the clean-up short
            raise StartupInterrupted(signum)


def run(args: argparse.Namespace) -> int:
    try:
        config, model_dir = config_from_args(args)
    except ShapeserveError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    if not port_is_free(config.host, config.port):
        print(f"error: {config.host}:{config.port} is already in use; pass another --port", file=sys.stderr)
        return 2
    problem = unreachable_ray_address(args.address) if args.address else None
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    from cluster.app import APP_NAME, SERVE_HTTP_CALLBACK, build_app, cluster_resources
    from cluster.serving.placement import describe, place_pools

    signals = StopSignals()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signals)
    own_ray = not args.address
    direct = own_ray and config.decode.num_replicas == 1 and config.decode.autoscaling is None
    proxy_port = free_port(config.host) if direct else config.port
    if direct:
        os.environ.update(direct_ingress_env(config.port))  # read by the Serve processes Ray starts below
        if config.prefill.autoscaling is None:
            for key, value in quiet_serve_env().items():
                os.environ.setdefault(key, value)  # the user's own value wins
    if own_ray:
        os.environ.update(ARENA_ENV)  # every process of our local Ray: see cluster.engine.host_memory
        for key, value in quiet_ray_env().items():
            os.environ.setdefault(key, value)  # read by the Ray processes started below; the user's own value wins
        # Serve's proxy and direct-ingress replicas read it: an unusable X-Request-Id is replaced before Serve takes
        # it as the request's id and response header (router.request_ids). A user's own callback wins.
        os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", SERVE_HTTP_CALLBACK)
    metrics_port = args.ray_metrics_port
    if own_ray and not port_is_free("0.0.0.0", metrics_port):
        print(f"note: port {metrics_port} is taken; Ray's metrics endpoint takes another one", flush=True)
        metrics_port = None
    deploying = False
    try:
        if own_ray:
            # address="local": always a Ray of our own, never someone else's running cluster.
            ray.init(
                address="local",
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                # Ray starts workers at nice 15, below its own daemons and any client on the machine; the
                # replicas here are the service, so they run at normal priority.
                _system_config={"worker_niceness": 0, "metrics_report_interval_ms": RAY_METRICS_REPORT_INTERVAL_MS},
                _metrics_export_port=metrics_port,
            )
            if config.kv_transfer_host is None:  # one machine: keep KV transfer off the network
                config = config.with_overrides(kv_transfer_host="127.0.0.1")
        else:
            ray.init(address=args.address, log_to_driver=False)
        placement = place_pools(config, *cluster_resources())
        print(describe(placement), flush=True)
        if own_ray:  # every replica lands on this host: their KV pools must fit in its memory together
            try:
                check_kv_pools_fit(host_kv_pools(config, model_dir, placement), available_memory_bytes(), KV_SETTINGS)
            except ConfigError as e:
                print(f"error: {e.message}", file=sys.stderr)
                return 2
        if config.pool_ratio is not None:
            # serve.run deploys without an application config, and Serve 2.60 takes an application-level
            # autoscaling policy only from one (cluster/serving/autoscaling.py).
            print(
                "note: pool_ratio is applied by the application-level autoscaling policy of a Serve config file "
                "(serve run / serve deploy deploy/serve-app.yaml); here each pool scales on its own load",
                flush=True,
            )
        serve.start(http_options={"host": config.host, "port": proxy_port})
        deploying = True  # from here an interrupted start leaves an application to delete
        try:
            serve.run(build_app(config, model_dir, placement), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as e:  # Serve: "Deploying application ... failed" once a replica failed to start
            app = serve.status().applications.get(APP_NAME)
            for line in (deploy_failures(app) if app is not None else []) or [str(e)]:
                print(f"error: {line}", file=sys.stderr)
            print(
                "(Serve tried each replica a few times; the whole error is in Serve's controller log: logs/serve/ "
                "in the Ray session's directory, /tmp/ray/session_latest on the head node)",
                file=sys.stderr,
            )
            return 1
        url = f"http://{config.host}:{config.port}"
        if not _wait_ready(url, args.ready_timeout):
            print(f"error: the pools did not become healthy within {args.ready_timeout:.0f} s", file=sys.stderr)
            return 1
        signals.interrupt_startup = False
        how = "the decode replica serves it directly" if direct else "through Serve's proxy"
        names = ", ".join(map(repr, config.served_model_names))
        key = "; an API key is required" if config.api_key else ""
        print(f"shapeserve is serving {names} at {url}/v1 ({how}{key}; Ctrl-C to stop)", flush=True)
        print(f"metrics: {url}/metrics (the whole cluster's); Ray's and Serve's: {ray_metrics_urls()}", flush=True)
        while not signals.stop.wait(0.5):
            pass
        print("shutting down", flush=True)
        return 0
    except StartupInterrupted as e:
        print(f"{e} before the server was ready: stopping", flush=True)
        if own_ray:
            deploying = False  # ray.shutdown() takes the application with the rest of our Ray, without a drain
        return 128 + e.signum  # the shell's status for a process ended by that signal
    finally:
        signals.interrupt_startup = False
        try:
            # The application drains (in-flight requests finish), then the Ray we started (or only our application
            # on someone else's cluster) goes. Not serve.shutdown(): its controller kills itself while the call to it
            # is pending, and Ray printed "Task ServeController.graceful_shutdown failed ..." at every Ctrl-C.
            if deploying:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
