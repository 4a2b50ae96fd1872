"""The shipped one-machine Serve config runs as shipped: ``serve run deploy/serve-app-local.yaml`` from the
repository root serves the demo model through Serve's proxy (only the port differs: a free one)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from bench.server_process import ServerProcess
from tests.helpers import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_serve_run_of_the_local_app_config(tmp_path, demo_model):
    app = yaml.safe_load((REPO / "deploy" / "serve-app-local.yaml").read_text())
    port = free_port()
    app["http_options"]["port"] = port
    # The shipped overrides are empty; the test's small model stands in for the demo model the builder would
    # otherwise build into the user's cache.
    assert app["applications"][0]["args"] == {"config": "deploy/shapeserve-local.yaml", "overrides": {}}
    app["applications"][0]["args"]["overrides"] = {"model": str(demo_model), "served_model_name": "demo"}
    config = tmp_path / "serve-app-local.yaml"
    config.write_text(yaml.safe_dump(app))
    serve_bin = shutil.which("serve") or str(Path(sys.executable).parent / "serve")
    server = ServerProcess(
        ["bash", "-c", f"cd {REPO} && exec {serve_bin} run {config}"],
        f"http://127.0.0.1:{port}",
        str(tmp_path / "serve-run.log"),
        env={"RAY_AUTH_MODE": "disabled"},
    )
    server.start(timeout_s=240)
    try:
        body = {"model": "demo", "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"] == "demo"
    finally:
        server.stop()
