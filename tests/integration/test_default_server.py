"""``shapeserve serve`` as a small node gets it by default (one decode replica that also prefills, direct ingress):
the decode replica serves the port and holds the pool board: no board replica, and /health, /admin/pools and
/metrics still answer from the board. (Serve 2.60 keeps one proxy on the head under direct ingress whatever
``proxy_location`` says.)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from bench.server_process import group_of
from cluster.tools.serve_cli import quiet_ray_env
from tests.helpers import free_port
from tests.integration.live_server import live_server, settled_scrape, total

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(demo_model, tmp_path_factory):
    with live_server(demo_model, tmp_path_factory.mktemp("default"), "device: cpu\nserved_model_name: demo") as proc:
        yield proc


def test_one_replica_and_no_board_process(server):
    groups = sorted(group_of(p) for p in server.tree())
    assert groups.count("decode replica (edge + engine)") == 1, groups
    assert "pool board" not in groups and "prefill replica" not in groups, groups


def test_the_in_process_board_reports_the_replica(server):
    body = {"model": "demo", "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code == 200
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    end = time.monotonic() + 20
    while True:  # the replica reports every routing_stats_period_s
        replicas = httpx.get(f"{server.url}/admin/pools", timeout=30).json()["replicas"]
        if [r["pool"] for r in replicas] == ["decode"] and replicas[0]["steps"] > 0:
            break
        assert time.monotonic() < end, replicas
        time.sleep(0.5)
    assert replicas[0]["healthy"] and replicas[0]["kv_blocks_total"] > 0, replicas
    page = settled_scrape(server.url)
    assert total(page, "shapeserve_requests_total", outcome="ok") == 1
    # The per-replica series come from the board's reports.
    assert any(name == "vllm:kv_cache_usage_perc" for name, _ in page), sorted({name for name, _ in page})


def test_rays_background_processes_run_with_the_quiet_settings(server):
    """The local Ray the CLI starts gets ``quiet_ray_env`` (the log monitor's rescans, task-event reports, event-loop
    timing): its daemons and workers read them from their environment."""
    by_group = {group_of(p): p for p in server.tree() if "log_monitor" in " ".join(p.cmdline()) or "raylet" in p.name()}
    assert set(by_group) == {"Ray monitors", "raylet"}, by_group
    for proc in by_group.values():
        env = proc.environ()
        assert {k: env.get(k) for k in quiet_ray_env()} == quiet_ray_env(), proc.cmdline()[:2]


def test_ctrl_c_stops_the_server_cleanly_and_quietly(server):
    """Last in this module: it stops the module's server. Ctrl-C (SIGINT) drains the application and stops the local
    Ray: exit status 0, every process of the tree gone, and nothing after "shutting down" that reads as a failure
    (Serve's own controller shutdown printed "Task ServeController.graceful_shutdown failed ... killed by
    `ray.kill`" at every Ctrl-C)."""
    tree = server.tree()
    server.stop()
    assert server.proc is not None and server.proc.returncode == 0
    time.sleep(1)
    assert not [p.pid for p in tree if p.is_running() and p.status() != "zombie"]
    log = open(server.log_path, errors="replace").read()
    after = log.split("shutting down", 1)[1]
    assert not [line for line in after.splitlines() if "fail" in line.lower() or "error" in line.lower()], after


def start_cli(model_dir, log_path) -> subprocess.Popen:
    """``shapeserve serve`` on ``model_dir`` (free ports, no token auth), its output in ``log_path``."""
    cmd = [sys.executable, "-m", "cluster.tools.cli", "serve", "--model", str(model_dir), "--port", str(free_port())]
    cmd += ["--ray-metrics-port", str(free_port())]
    with open(log_path, "w") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RAY_AUTH_MODE": "disabled"}
        )


def test_ctrl_c_during_start_up_stops_it_there(demo_model, tmp_path):
    """Ctrl-C while the server starts (here: once Ray is up, before the replica has loaded its model) stops the start
    where it is, instead of after the model load (which can take minutes): exit status 130, the server never
    announced, no process left behind."""
    log_path = tmp_path / "server.log"
    proc = start_cli(demo_model, log_path)
    try:
        end = time.monotonic() + 120
        while "pools:" not in log_path.read_text(errors="replace"):  # printed once Ray is up
            assert proc.poll() is None and time.monotonic() < end, log_path.read_text(errors="replace")
            time.sleep(0.05)
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 128 + signal.SIGINT
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text(errors="replace")
    assert "SIGINT before the server was ready: stopping" in log and "is serving" not in log, log
    time.sleep(1)
    assert not [p.pid for p in tree if p.is_running() and p.status() != "zombie"]


def test_a_replica_that_cannot_start_is_reported_with_its_cause(demo_model, tmp_path):
    """A checkpoint that config.json's architecture does not match (a tensor missing) fails in the replica, where
    Serve only says "Failed to update the deployments": the CLI prints the replica's own error, no traceback, and
    exits 1."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "model"
    shutil.copytree(demo_model, model_dir)
    weights = next(model_dir.glob("*.safetensors"))
    tensors = load_file(str(weights))
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, str(weights))

    log_path = tmp_path / "server.log"
    proc = start_cli(model_dir, log_path)
    try:
        assert proc.wait(300) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text(errors="replace")
    expected = f"the decode pool's replica did not start: ModelLoadError: checkpoint in '{model_dir}' lacks tensors"
    assert f"error: {expected}" in log and "layers.0.down_proj.weight" in log, log
    assert "Traceback" not in log and "is serving" not in log, log
