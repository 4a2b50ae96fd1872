"""``shapeserve serve``: the serving cluster on a local, in-process Ray (or an existing cluster).

By default: one prefill and one decode replica plus the router on CPU, serving the built-in
demo model (built into the cache dir on first use). Prints the URL once ``/health`` answers
200; Ctrl-C (or SIGTERM) shuts Serve and Ray down cleanly.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from cluster.errors import ShapeserveError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local Hugging Face model directory (default: the demo model)")
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="weights and KV dtype"
    )
    parser.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port to listen on (default 8000)")
    parser.add_argument("--config", default=None, help="ServeConfig YAML (pools, classifier, admission, timeouts)")
    parser.add_argument("--address", default=None, help="connect to a running Ray cluster instead of starting one")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for both pools")


def _wait_ready(url: str, timeout_s: float) -> bool:
    import httpx

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def run(args: argparse.Namespace) -> int:
    from cluster.serving.config import load_serve_config

    try:
        config = load_serve_config(args.config).with_overrides(
            model=args.model, dtype=args.dtype, host=args.host, port=args.port
        )
        model_dir = config.model
        if model_dir is None:
            from cluster.tools.demo_model import ensure_demo_model

            model_dir = str(ensure_demo_model())
        from cluster.config import ModelConfig

        ModelConfig.from_pretrained(model_dir)  # fail fast, before Ray starts, on a bad directory
    except ShapeserveError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2

    import ray
    from ray import serve

    from cluster.app import APP_NAME, build_app

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started_ray = False
    try:
        if not ray.is_initialized():
            if args.address:
                ray.init(address=args.address)
            else:
                ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
                if config.kv_transfer_host is None:  # one machine: keep KV transfer off the network
                    config = config.with_overrides(kv_transfer_host="127.0.0.1")
            started_ray = True
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(build_app(config, model_dir), name=APP_NAME, route_prefix="/", blocking=False)
        url = f"http://{config.host}:{config.port}"
        if not _wait_ready(url, args.ready_timeout):
            print(f"error: the pools did not become healthy within {args.ready_timeout:.0f} s", file=sys.stderr)
            return 1
        print(f"shapeserve is serving {config.model_name!r} at {url}/v1 (Ctrl-C to stop)", flush=True)
        while not stop.wait(0.5):
            pass
        print("shutting down", flush=True)
        return 0
    finally:
        try:
            serve.shutdown()
        finally:
            if started_ray:
                ray.shutdown()
