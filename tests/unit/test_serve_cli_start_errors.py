"""``shapeserve serve`` refuses what cannot work before it starts anything, with exit status 2 and an ``error:``
line that says what to change."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from cluster.engine.host_memory import available_memory_bytes
from tests.helpers import free_port


def serve(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cluster.tools.cli", "serve", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_AUTH_MODE": "disabled"}
    )


def test_an_address_nothing_answers_at_is_refused_at_once(demo_model):
    """``ray.init`` retried such an address for minutes, printing gRPC warnings."""
    port = free_port()  # nothing listens there
    done = serve("--model", str(demo_model), "--port", str(free_port()), "--address", f"127.0.0.1:{port}")
    assert done.returncode == 2, done.stderr
    assert f"error: no Ray cluster answers at 127.0.0.1:{port} (Connection refused)" in done.stderr, done.stderr
    assert "ray start --head" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("address", ["10.0.0.5", "ray://10.0.0.5", ":6379", "10.0.0.5:http"])
def test_an_address_that_is_not_host_and_port_is_refused(demo_model, address):
    done = serve("--model", str(demo_model), "--port", str(free_port()), "--address", address)
    assert done.returncode == 2, done.stderr
    expected = "error: --address takes the head node's host:port (e.g. 10.0.0.5:6379), ray://host:port or auto"
    assert f"{expected}, not {address!r}" in done.stderr, done.stderr


def test_a_port_in_use_is_refused(demo_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve("--model", str(demo_model), "--port", str(port))
    assert done.returncode == 2, done.stderr
    assert f"error: 127.0.0.1:{port} is already in use; pass another --port" in done.stderr


def test_kv_pools_larger_than_the_hosts_memory_are_refused_before_any_replica_starts(demo_model, tmp_path):
    """Each replica would fail its start (three times: Serve retries it) before the CLI could say why."""
    gb = available_memory_bytes() / 2**30 * 2 + 1
    config = tmp_path / "serve.yaml"
    config.write_text(f"shapeserve:\n  device: cpu\n  decode:\n    kv_cache_memory_gb: {gb}\n")
    done = serve("--model", str(demo_model), "--port", str(free_port()), "--config", str(config))
    assert done.returncode == 2, done.stderr
    assert "error: the KV cache takes" in done.stderr and "(decode: 1 x " in done.stderr, done.stderr
    assert "lower decode.kv_cache_memory_gb / prefill.kv_cache_memory_gb" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "Started Serve" not in done.stdout + done.stderr
